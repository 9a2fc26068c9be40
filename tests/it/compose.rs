//! The container setup: docker-compose.yml is valid YAML with the promised services and health
//! checks, its host ports leave the README's quick start (8080, 9901) free, the configuration
//! it mounts (and the image ships) passes `tollgate check`, the Dockerfile ships that
//! configuration and runs as a numeric non-root user, and `.dockerignore` keeps target/ and
//! .git out of the build context while letting in everything the Dockerfile copies. (CI has no
//! Docker engine, so these are checked by reading the files; deploy/smoke.sh runs the stack
//! for real where dockerd runs.)

use crate::common::repo;
use std::process::Command;

#[test]
fn compose_file_is_valid_and_complete() {
    let text = std::fs::read_to_string(repo("docker-compose.yml")).expect("docker-compose.yml");
    let mut doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("valid YAML");
    doc.apply_merge().expect("merge keys resolve");
    let services = doc["services"].as_mapping().expect("services");
    for name in ["postgres", "upstream", "tollgate-a", "tollgate-b"] {
        let service = services
            .get(name)
            .unwrap_or_else(|| panic!("service {name} missing"));
        assert!(
            service.get("healthcheck").is_some(),
            "service {name} has no health check"
        );
    }
    // The database keeps its data in a named volume: `docker compose down` must not lose
    // every counter and the key fingerprint without a word (only `down -v` drops them).
    let data: Vec<&str> = services["postgres"]["volumes"]
        .as_sequence()
        .expect("postgres volumes")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert_eq!(data, ["pgdata:/var/lib/postgresql/data"]);
    assert!(
        doc["volumes"].get("pgdata").is_some(),
        "the named volume is declared"
    );
    // The image `docker build -t TAG .` gives (the Dockerfile's first lines say how), so that
    // building it either way serves both, instead of two tags built twice.
    let dockerfile = std::fs::read_to_string(repo("Dockerfile")).expect("Dockerfile");
    let tag = dockerfile
        .split("docker build -t ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the Dockerfile says how to build it");
    for replica in ["tollgate-a", "tollgate-b"] {
        let service = &services[replica];
        assert_eq!(service["build"], ".", "{replica} builds the Dockerfile");
        assert_eq!(
            service["image"], tag,
            "{replica} runs the image docker build makes"
        );
        let volumes: Vec<&str> = service["volumes"]
            .as_sequence()
            .expect("volumes")
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert!(
            volumes
                .iter()
                .any(|v| v.starts_with("${TOLLGATE_COMPOSE_CONFIG:-./docker/proxy.toml}:")),
            "{replica} mounts docker/proxy.toml (or the smoke test's copy): {volumes:?}"
        );
        assert_eq!(
            service["depends_on"]["postgres"]["condition"],
            "service_healthy"
        );
    }
    // Two replicas must publish different host ports, and none the quick start uses
    // (proxy.toml.example: 127.0.0.1:8080 and :9901), so following the README in order works.
    let mut published = Vec::new();
    for service in services.values() {
        for port in service["ports"].as_sequence().into_iter().flatten() {
            let port = port.as_str().expect("ports are strings");
            let (host_port, _) = port.rsplit_once(':').expect("host:port:container");
            published.push(host_port.to_string());
        }
    }
    let mut unique = published.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        published.len(),
        "a host port is published twice: {published:?}"
    );
    for host_port in &published {
        let port = host_port.rsplit(':').next().unwrap_or(host_port);
        assert!(
            port != "8080" && port != "9901",
            "compose publishes {host_port}, a port the quick start takes: {published:?}"
        );
    }
    // The demo backend is the repository's, the one the README's quick start uses.
    let upstream = format!("{:?}", services["upstream"]);
    assert!(upstream.contains("examples/demo_backend.py"), "{upstream}");
    // `name:` needs Compose v2; the README must say so.
    let readme = std::fs::read_to_string(repo("README.md")).expect("README.md");
    assert!(
        readme.contains("Compose v2"),
        "README.md does not say Compose v2 is needed"
    );
}

#[test]
fn the_image_ships_a_configuration_and_runs_as_a_numeric_non_root_user() {
    let dockerfile = std::fs::read_to_string(repo("Dockerfile")).expect("Dockerfile");
    let last_stage = dockerfile.rsplit("\nFROM ").next().expect("a FROM line");
    assert!(
        last_stage.contains("COPY docker/proxy.toml /etc/tollgate/proxy.toml"),
        "the runtime image ships no configuration"
    );
    let user = last_stage
        .lines()
        .filter_map(|l| l.strip_prefix("USER "))
        .next_back()
        .expect("a USER line in the runtime stage");
    let uid = user.split(':').next().unwrap_or("");
    assert!(
        uid.parse::<u32>().is_ok_and(|uid| uid != 0),
        "USER {user}: Kubernetes' runAsNonRoot needs a numeric, non-zero uid"
    );
    // The dependency layer: Cargo.toml and Cargo.lock are copied and built before src/.
    let manifests = dockerfile
        .find("COPY Cargo.toml Cargo.lock")
        .expect("manifests copied");
    let sources = dockerfile.find("COPY src ").expect("sources copied");
    let build = dockerfile.find("cargo build").expect("a cargo build");
    assert!(
        manifests < build && build < sources,
        "no dependency layer before the sources"
    );
}

/// Whether `path` is sent to the daemon: the last `.dockerignore` pattern that matches it
/// decides (this file uses only `*`, `NAME` and `!NAME`, where NAME covers a path and what is
/// under it).
fn in_build_context(patterns: &[String], path: &str) -> bool {
    let mut included = true;
    for pattern in patterns {
        let (negated, pattern) = match pattern.strip_prefix('!') {
            Some(p) => (true, p),
            None => (false, pattern.as_str()),
        };
        let pattern = pattern.trim_end_matches('/');
        assert!(
            pattern == "*" || !pattern.contains(['*', '?', '[']),
            "in_build_context does not understand the .dockerignore pattern {pattern:?}"
        );
        if pattern == "*" || path == pattern || path.starts_with(&format!("{pattern}/")) {
            included = negated;
        }
    }
    included
}

#[test]
fn the_build_context_holds_what_the_dockerfile_copies_and_nothing_big() {
    let ignore = std::fs::read_to_string(repo(".dockerignore")).expect(".dockerignore");
    let patterns: Vec<String> = ignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    for out in [
        "target",
        "target/release/tollgate",
        ".git",
        "bench/results",
        "tests/common/db.rs",
    ] {
        assert!(
            !in_build_context(&patterns, out),
            "{out} is sent to the daemon"
        );
    }
    let dockerfile = std::fs::read_to_string(repo("Dockerfile")).expect("Dockerfile");
    let mut copied = 0;
    for line in dockerfile.lines() {
        let Some(args) = line.strip_prefix("COPY ") else {
            continue;
        };
        if args.starts_with("--from") {
            continue;
        }
        let words: Vec<&str> = args.split_whitespace().collect();
        for source in &words[..words.len() - 1] {
            copied += 1;
            assert!(
                in_build_context(&patterns, source),
                "the Dockerfile copies {source}, which .dockerignore leaves out"
            );
            assert!(
                repo(source).exists(),
                "the Dockerfile copies {source}, which does not exist"
            );
        }
    }
    assert!(
        copied >= 4,
        "found only {copied} COPY sources in the Dockerfile"
    );
}

/// The bytes of the files under `dir` (a path relative to the repository) that the build
/// context holds, descending only where something may be included.
fn context_bytes(patterns: &[String], dir: &str) -> u64 {
    let mut total = 0;
    let full = if dir.is_empty() { repo(".") } else { repo(dir) };
    for entry in std::fs::read_dir(&full).expect("read dir") {
        let entry = entry.expect("entry");
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = if dir.is_empty() {
            name
        } else {
            format!("{dir}/{name}")
        };
        let kind = entry.file_type().expect("file type");
        if kind.is_dir() {
            let inside = format!("!{path}/");
            if in_build_context(patterns, &path) || patterns.iter().any(|p| p.starts_with(&inside))
            {
                total += context_bytes(patterns, &path);
            }
        } else if in_build_context(patterns, &path) {
            total += entry.metadata().expect("metadata").len();
        }
    }
    total
}

/// docs/operations.md gives the context's size (the sources, about 1.6 MB); past 3 MB
/// something large got in, or the docs' figure is far off.
#[test]
fn the_build_context_is_the_sources_and_stays_small() {
    let ignore = std::fs::read_to_string(repo(".dockerignore")).expect(".dockerignore");
    let patterns: Vec<String> = ignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    let bytes = context_bytes(&patterns, "");
    let sources = context_bytes(&patterns, "src");
    assert!(
        sources > bytes / 2,
        "the context ({bytes} B) is mostly src/ ({sources} B)"
    );
    assert!(
        bytes < 3_000_000,
        "the build context is {bytes} bytes: see .dockerignore and docs/operations.md"
    );
}

fn check_image_config(database_url: Option<&str>) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command
        .args(["check", "--config"])
        .arg(repo("docker/proxy.toml"))
        .env("TOLLGATE_KEY_SECRET", "compose-test")
        .env_remove("TOLLGATE_UPSTREAM_URL")
        .env_remove("TOLLGATE_DATABASE_URL");
    if let Some(url) = database_url {
        command.env("TOLLGATE_DATABASE_URL", url);
    }
    let out = command.output().expect("run check");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn compose_configuration_passes_check() {
    // As compose runs it: the database URL from the environment.
    let stdout = check_image_config(Some("postgres://tollgate:tollgate@postgres:5432/tollgate"));
    assert!(stdout.contains("store       postgres"), "{stdout}");
    // As `docker run` runs the image with only the key secret: counters in memory.
    let stdout = check_image_config(None);
    assert!(stdout.contains("store       memory"), "{stdout}");
    assert!(stdout.contains("upstream:9000"), "{stdout}");
}
