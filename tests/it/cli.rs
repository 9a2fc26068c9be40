//! The command line (contract §1): `check` on every broken fixture exits 2 and names each
//! problem's place; the example configuration passes; `--version` works; `run` with a broken
//! file exits 2 and with a taken port exits 1.

use crate::common::repo;
use std::process::{Command, Output};

fn tollgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .env_remove("TOLLGATE_CONFIG")
        .env_remove("TOLLGATE_DATABASE_URL")
        .env_remove("TOLLGATE_KEY_SECRET")
        .output()
        .expect("run tollgate")
}

#[test]
fn example_configuration_passes_check() {
    let path = repo("proxy.toml.example");
    let out = tollgate(&["check", "--config", path.to_str().expect("utf-8 path")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "check failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("configuration OK"), "{stdout}");
    assert!(stdout.contains("route       login"), "{stdout}");
    assert!(stdout.contains("login:ip 5 per 60s"), "{stdout}");
}

/// `check` speaks the file's language: policies as the file spells them (`local`, not the
/// Rust `Local`), upstream URLs as written, without a `/` the user never typed.
#[test]
fn check_prints_values_as_the_file_spells_them() {
    let dir = std::env::temp_dir().join(format!("tollgate-cli-spelling-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        "[store]\nurl = \"postgres://tollgate@127.0.0.1:9/none\"\non_error = \"local\"\n\
         [upstreams.a]\nurls = [\"http://127.0.0.1:9\", \"http://b.test:8080\"]\n\
         [[routes]]\nname = \"r\"\nupstream = \"a\"\non_store_error = \"deny\"\n",
    )
    .expect("write config");
    let out = tollgate(&["check", "--config", path.to_str().expect("utf-8 path")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("store       postgres (on_error = local)"),
        "{stdout}"
    );
    assert!(stdout.contains("(on_store_error = deny)"), "{stdout}");
    assert!(
        stdout.contains("upstream    a -> http://127.0.0.1:9, http://b.test:8080\n"),
        "{stdout}"
    );
    for debug in ["Local", "Deny", "Allow", ":9/", ":8080/"] {
        assert!(!stdout.contains(debug), "{debug} in {stdout}");
    }
}

#[test]
fn every_broken_fixture_exits_2_naming_each_place() {
    let dir = repo("tests/fixtures");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("fixtures dir") {
        let path = entry.expect("entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !(name.starts_with("bad_") && name.ends_with(".toml")) {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("fixture");
        let expected: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# expect: "))
            .collect();
        assert!(!expected.is_empty(), "{name} has no '# expect:' line");
        let out = tollgate(&["check", "--config", path.to_str().expect("utf-8 path")]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {stderr}");
        for want in expected {
            let want = format!("{}:{}", path.display(), want.trim());
            assert!(
                stderr.lines().any(|l| l.starts_with(&want)),
                "{name}: expected a line starting with\n  {want}\ngot:\n{stderr}"
            );
        }
        checked += 1;
    }
    assert!(checked >= 8, "only {checked} broken fixtures found");
}

#[test]
fn version_and_usage() {
    let out = tollgate(&["--version"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("tollgate "));
    let out = tollgate(&["no-such-command"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn missing_config_file_exits_2() {
    let out = tollgate(&["check", "--config", "/nonexistent/proxy.toml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/proxy.toml"));
}

/// A newcomer who runs `tollgate` where there is no `proxy.toml` is told how to give one:
/// both ways (`--config`, `TOLLGATE_CONFIG`), and which of them chose the missing path.
#[test]
fn missing_config_file_says_how_to_give_one() {
    let dir = std::env::temp_dir().join(format!("tollgate-cli-noconf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let run = |args: &[&str], env: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        command
            .args(args)
            .current_dir(&dir)
            .env_remove("TOLLGATE_CONFIG")
            .env_remove("TOLLGATE_DATABASE_URL");
        if let Some(value) = env {
            command.env("TOLLGATE_CONFIG", value);
        }
        let out = command.output().expect("run tollgate");
        assert_eq!(out.status.code(), Some(2));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    for (args, env, names) in [
        (
            &["check"][..],
            None,
            "neither --config nor TOLLGATE_CONFIG is set",
        ),
        (
            &["check"][..],
            Some("/nonexistent/env.toml"),
            "TOLLGATE_CONFIG names /nonexistent/env.toml",
        ),
        (
            &["check", "--config", "/nonexistent/flag.toml"][..],
            None,
            "given with --config",
        ),
    ] {
        let stderr = run(args, env);
        assert!(stderr.contains("cannot read"), "{stderr}");
        assert!(stderr.contains(names), "{stderr}");
        assert!(
            stderr.contains("--config PATH") && stderr.contains("TOLLGATE_CONFIG=PATH"),
            "{stderr}"
        );
    }
    // A file that exists but is broken gets no such hint: the path was right.
    let broken = dir.join("proxy.toml");
    std::fs::write(&broken, "[server\n").expect("write");
    let stderr = run(&["check"], None);
    assert!(!stderr.contains("TOLLGATE_CONFIG=PATH"), "{stderr}");
    std::fs::remove_file(&broken).expect("remove");
}

#[test]
fn port_in_use_exits_1_with_one_line() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let dir = std::env::temp_dir().join(format!("tollgate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("port.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = [\"{addr}\"]\n[upstreams.a]\nurl = \"http://127.0.0.1:9\"\n\
             [[routes]]\nname = \"r\"\nupstream = \"a\"\n"
        ),
    )
    .expect("write config");
    let out = tollgate(&["run", "--config", path.to_str().expect("utf-8 path")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("tollgate: cannot listen on")),
        "{stderr}"
    );
}

/// The README's layout section names every module under `src/`, so a newcomer finds each
/// file's purpose there (issue 19: several were missing).
#[test]
fn readme_layout_lists_every_module() {
    let readme = std::fs::read_to_string(repo("README.md")).expect("README.md");
    let layout = readme
        .split("## Layout")
        .nth(1)
        .and_then(|rest| rest.split("```").nth(1))
        .expect("a Layout section with a code block");
    let listed: Vec<&str> = layout
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let mut missing = Vec::new();
    let mut stack = vec![repo("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("src dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path
                    .strip_prefix(env!("CARGO_MANIFEST_DIR"))
                    .expect("under the crate")
                    .to_string_lossy()
                    .into_owned();
                if !listed.contains(&relative.as_str()) {
                    missing.push(relative);
                }
            }
        }
    }
    assert!(missing.is_empty(), "README layout lacks {missing:?}");
}
