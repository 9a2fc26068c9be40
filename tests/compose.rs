//! The container setup: docker-compose.yml is valid YAML with the promised services and health
//! checks, and the configuration it mounts passes `tollgate check`. (No Docker engine runs on
//! the build machines, so the file is checked by parsing it.)

use std::path::Path;
use std::process::Command;

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

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
    for replica in ["tollgate-a", "tollgate-b"] {
        let service = &services[replica];
        assert_eq!(service["build"], ".", "{replica} builds the Dockerfile");
        let volumes: Vec<&str> = service["volumes"]
            .as_sequence()
            .expect("volumes")
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert!(
            volumes
                .iter()
                .any(|v| v.starts_with("./docker/proxy.toml:")),
            "{replica} mounts docker/proxy.toml"
        );
        assert_eq!(
            service["depends_on"]["postgres"]["condition"],
            "service_healthy"
        );
    }
    // Two replicas must publish different host ports.
    let ports = |s: &str| format!("{:?}", services[s]["ports"]);
    assert_ne!(ports("tollgate-a"), ports("tollgate-b"));
    assert!(repo("Dockerfile").exists());
}

#[test]
fn compose_configuration_passes_check() {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config"])
        .arg(repo("docker/proxy.toml"))
        .env("TOLLGATE_KEY_SECRET", "compose-test")
        .env_remove("TOLLGATE_DATABASE_URL")
        .output()
        .expect("run check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("store       postgres"), "{stdout}");
}
