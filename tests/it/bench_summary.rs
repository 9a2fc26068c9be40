//! bench/run.sh's summary (issue 18): when a sliding-window mode ran next to its fixed-window
//! mode, the targets table says what the sliding one costs as a same-run ratio, checked
//! against the 0.9. Tested on canned result files through `bench/run.sh --summarize`
//! (the script's own path to bench/lib/benchlib.py), so no load is run. Needs python3, as
//! the bench does (.ci/run installs it).

use std::path::{Path, PathBuf};
use std::process::Command;

const HEAD: &str = "rep\tproto\tconns\ttarget\trps\tp50_us\tp99_us\trequests\tnon2xx\terrors\t\
                    warm_requests\tdb_stmts\tdb_rows\tstore_calls\tstore_errors\trss_kib\tcpu_busy";

/// A results folder of its own, removed when dropped.
struct ResultsDir(PathBuf);

impl ResultsDir {
    /// A folder holding `env.txt` and a `runs.tsv` of `rows`: (round, protocol, target, req/s),
    /// all at 32 connections.
    fn with_runs(name: &str, rows: &[(u32, &str, &str, u32)]) -> ResultsDir {
        let dir = std::env::temp_dir().join(format!(
            "tollgate-bench-summary-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("results dir");
        let mut tsv = format!("{HEAD}\n");
        for (rep, proto, target, rps) in rows {
            tsv.push_str(&format!(
                "{rep}\t{proto}\t32\t{target}\t{rps}\t900\t3000\t{}\t0\t0\t1000\tNA\tNA\tNA\tNA\t20000\t90/60\n",
                rps * 10
            ));
        }
        std::fs::write(dir.join("runs.tsv"), tsv).expect("runs.tsv");
        std::fs::write(dir.join("env.txt"), "canned results for a test\n").expect("env.txt");
        ResultsDir(dir)
    }

    /// `bench/run.sh --summarize` on this folder: its output, which must equal summary.md.
    fn summarize(&self) -> String {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/run.sh");
        let out = Command::new("bash")
            .arg(&script)
            .arg("--summarize")
            .arg(&self.0)
            .output()
            .expect("run bash bench/run.sh --summarize (bash and python3 are needed)");
        assert!(
            out.status.success(),
            "bench/run.sh --summarize failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let printed = String::from_utf8_lossy(&out.stdout).into_owned();
        let written = std::fs::read_to_string(self.0.join("summary.md")).expect("summary.md");
        assert_eq!(
            printed.trim_end(),
            written.trim_end(),
            "prints what it wrote"
        );
        printed
    }
}

impl Drop for ResultsDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn sliding_lines(summary: &str) -> Vec<&str> {
    summary
        .lines()
        .filter(|l| l.contains("sliding / fixed"))
        .collect()
}

/// Both pairs in one run: each gets a line with the median of its same-round ratios and the
/// verdict against 0.9. The hot key's rounds are 0.95, 0.90 and 1.00 (median 0.95), where
/// the ratio of the medians would say 0.98: the pairing is by round. The 10k keys' median is
/// 0.85: not met. In h2 only the sliding mode ran, so there is no h2 line.
#[test]
fn a_sliding_mode_next_to_its_fixed_mode_gets_a_same_run_ratio_line() {
    let mut rows = Vec::new();
    let runs = [
        ("tollgate-memory", [20000, 20000, 20000]),
        ("tollgate-pg-hot", [10000, 12000, 11000]),
        ("tollgate-pg-hot-sliding", [9500, 10800, 11000]),
        ("tollgate-pg-10k", [8000, 8000, 8000]),
        ("tollgate-pg-10k-sliding", [6400, 6800, 8800]),
    ];
    for rep in 1..=3u32 {
        for (target, rps) in &runs {
            rows.push((rep, "h1", *target, rps[rep as usize - 1]));
        }
        rows.push((rep, "h2", "tollgate-pg-hot-sliding", 9000));
    }
    let dir = ResultsDir::with_runs("pairs", &rows);
    let summary = dir.summarize();
    let lines = sliding_lines(&summary);
    assert_eq!(lines.len(), 2, "one line per pair, h1 only:\n{summary}");
    assert_eq!(
        lines[0],
        "| sliding / fixed: pg-hot-sliding ≥ 0.9 × pg-hot | h1 | 32 | 0.95 × pg-hot \
         (median of same-round ratios) | met |"
    );
    assert_eq!(
        lines[1],
        "| sliding / fixed: pg-10k-sliding ≥ 0.9 × pg-10k | h1 | 32 | 0.85 × pg-10k \
         (median of same-round ratios) | **not met** |"
    );
}

/// The default modes (no sliding one), or a sliding mode without its fixed one: no line.
#[test]
fn without_both_modes_of_a_pair_there_is_no_ratio_line() {
    let mut rows = Vec::new();
    for rep in 1..=2u32 {
        rows.push((rep, "h1", "tollgate-memory", 20000));
        rows.push((rep, "h1", "tollgate-pg-hot", 11000));
        rows.push((rep, "h1", "tollgate-pg-10k-sliding", 7000));
    }
    let dir = ResultsDir::with_runs("alone", &rows);
    let summary = dir.summarize();
    assert!(
        summary.contains("| Postgres hot key ≥ 0.8 × memory | h1 | 32 | 0.55 × memory |"),
        "the rest of the targets table is there:\n{summary}"
    );
    assert_eq!(sliding_lines(&summary), Vec::<&str>::new(), "{summary}");
}

/// With the ceiling proxy in the run (issue 16), its row is labelled and the targets table
/// puts tollgate's ratios next to the ceiling's, from the same rounds.
#[test]
fn the_ceiling_is_reported_beside_tollgate() {
    let mut rows = Vec::new();
    for (rep, nginx) in [(1u32, 20000), (2, 25000)] {
        rows.push((rep, "h1", "nginx", nginx));
        rows.push((rep, "h1", "ceiling", nginx / 100 * 104));
        rows.push((rep, "h1", "tollgate-memory", nginx / 100 * 70));
        rows.push((rep, "h1", "tollgate-nolimit", nginx / 100 * 75));
    }
    let dir = ResultsDir::with_runs("ceiling", &rows);
    let summary = dir.summarize();
    assert!(
        summary.contains("| hyper ceiling | inline upstream | 32 | h1 |"),
        "the ceiling's row:\n{summary}"
    );
    assert!(
        summary.contains(
            "| hyper-inline ceiling (bench/ceiling), for reference | h1 | 32 | 1.04 × nginx; \
             tollgate memory 0.70; nolimit 0.75 | – |"
        ),
        "the ceiling line of the targets table:\n{summary}"
    );
}

/// With `BASE_BIN` (the build before a change, run as `base-<mode>` in the same rounds), each
/// mode gets a line with this build / the base as the median of same-round ratios, every
/// round's ratio listed: 1.10, 0.90 and 1.05 here (median 1.05), where the ratio of the two
/// medians would say 1.02. A mode without its base gets no line.
#[test]
fn a_base_build_in_the_same_rounds_gets_a_paired_ratio_line() {
    let mut rows = Vec::new();
    for (rep, this, base) in [(1u32, 11000, 10000), (2, 9000, 10000), (3, 10500, 10000)] {
        rows.push((rep, "h1", "nginx", 20000));
        rows.push((rep, "h1", "tollgate-memory", this));
        rows.push((rep, "h1", "base-memory", base));
        rows.push((rep, "h1", "tollgate-nolimit", 12000));
    }
    let dir = ResultsDir::with_runs("base", &rows);
    let summary = dir.summarize();
    let lines: Vec<&str> = summary.lines().filter(|l| l.contains("BASE_BIN")).collect();
    assert_eq!(
        lines,
        vec![
            "| tollgate (BASE_BIN) | memory | 32 | h1 | 10,000 | 0.90 | 3.00 | 0.50 | 0.95 | 0 \
             | – | – | – | 19.5 | 90/60 | 3 |",
            "| this build / BASE_BIN: memory | h1 | 32 | 1.050 (median of 3 same-round ratios; \
             0.90, 1.05, 1.10) | – |",
        ],
        "{summary}"
    );
}
