//! deploy/kubernetes/: every manifest validates against the Kubernetes schemas (PyPI's
//! `kubernetes-validate`, offline, strict: unknown fields are errors), the validator does
//! reject a broken manifest, the ConfigMap's TOML passes `tollgate check`, and the manifests
//! agree with that configuration (ports, probes, grace period, migrations, secrets).

use crate::common::repo;
use std::path::PathBuf;
use std::process::{Command, Output};

use serde_yaml::Value;

fn manifests() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo("deploy/kubernetes"))
        .expect("deploy/kubernetes")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .filter(|p| p.file_name().is_some_and(|n| n != "kustomization.yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "{files:?}");
    files
}

fn load(name: &str) -> Value {
    let path = repo("deploy/kubernetes").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

fn validate(version: Option<&str>, files: &[PathBuf]) -> Output {
    let mut command = Command::new("kubernetes-validate");
    command.args(["--strict", "--no-warn"]);
    if let Some(version) = version {
        command.args(["-k", version]);
    }
    command.args(files).output().unwrap_or_else(|e| {
        panic!(
            "kubernetes-validate is needed ({e}): `python3 -m pip install kubernetes-validate` \
             (.ci/run installs it)"
        )
    })
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn manifests_validate_against_the_kubernetes_schemas() {
    let files = manifests();
    // The oldest Kubernetes still commonly run, and the validator's newest.
    for version in [Some("1.29.0"), None] {
        let out = validate(version, &files);
        assert!(out.status.success(), "{version:?}: {}", text(&out));
        for file in &files {
            let name = file.file_name().and_then(|n| n.to_str()).expect("name");
            assert!(
                text(&out).contains(&format!("{name} passed")),
                "{name} not validated ({version:?}): {}",
                text(&out)
            );
        }
    }
}

#[test]
fn the_validator_rejects_a_broken_manifest() {
    let good = std::fs::read_to_string(repo("deploy/kubernetes/pdb.yaml")).expect("pdb.yaml");
    let dir = std::env::temp_dir().join(format!("tollgate-k8s-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for (name, broken) in [
        (
            "typo.yaml",
            good.replace("maxUnavailable: 1", "maxUnavailabel: 1"),
        ),
        (
            "type.yaml",
            good.replace("maxUnavailable: 1", "maxUnavailable: [1]"),
        ),
    ] {
        assert_ne!(broken, good);
        let path = dir.join(name);
        std::fs::write(&path, broken).expect("write");
        let out = validate(None, &[path]);
        assert!(!out.status.success(), "{name} passed: {}", text(&out));
    }
}

#[test]
fn the_kustomization_lists_every_manifest_but_the_example_secret() {
    let kustomization = load("kustomization.yaml");
    let mut listed: Vec<&str> = kustomization["resources"]
        .as_sequence()
        .expect("resources")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    listed.sort();
    let mut expected: Vec<String> = manifests()
        .iter()
        .filter_map(|p| p.file_name().and_then(|n| n.to_str()).map(String::from))
        .filter(|n| n != "secret.example.yaml")
        .collect();
    expected.sort();
    assert_eq!(listed, expected);
}

/// The ConfigMap's proxy.toml, written to a file for `tollgate check`.
fn configmap_toml() -> (String, PathBuf) {
    let configmap = load("configmap.yaml");
    let toml = configmap["data"]["proxy.toml"]
        .as_str()
        .expect("data.proxy.toml")
        .to_string();
    let dir = std::env::temp_dir().join(format!("tollgate-k8s-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(&path, &toml).expect("write");
    (toml, path)
}

#[test]
fn the_configmap_passes_check_with_the_secret_s_variables() {
    let (toml, path) = configmap_toml();
    let check = |env: &[(&str, &str)]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        command
            .args(["check", "--config"])
            .arg(&path)
            .env_remove("TOLLGATE_CONFIG")
            .env_remove("TOLLGATE_DATABASE_URL")
            .env_remove("TOLLGATE_KEY_SECRET");
        for (k, v) in env {
            command.env(k, v);
        }
        command.output().expect("run tollgate check")
    };
    let out = check(&[
        ("TOLLGATE_KEY_SECRET", "k8s-test-secret"),
        (
            "TOLLGATE_DATABASE_URL",
            "postgres://tollgate@db.example.internal/tollgate",
        ),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("store       postgres"),
        "{}",
        text(&out)
    );
    // Without the Secret's variables the file is refused, rather than run with no key or
    // with counters in memory.
    let out = check(&[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("TOLLGATE_DATABASE_URL"),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("TOLLGATE_KEY_SECRET"), "{}", text(&out));
    // The pods do not migrate: the Job does.
    let doc: toml_edit::DocumentMut = toml.parse().expect("TOML");
    assert_eq!(doc["store"]["migrate"].as_bool(), Some(false));
}

fn seconds(duration: &str) -> u64 {
    duration
        .strip_suffix('s')
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{duration:?} is not whole seconds"))
}

fn port_of(listen: &str) -> u64 {
    listen
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{listen:?} has no port"))
}

fn container_port(container: &Value, name: &str) -> u64 {
    container["ports"]
        .as_sequence()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port {name}"))
}

/// Checks a pod spec's security settings, secret variables and configuration mount.
fn check_pod(what: &str, pod: &Value) {
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{what}");
    assert!(
        pod["securityContext"]["runAsUser"]
            .as_u64()
            .is_some_and(|u| u != 0),
        "{what}"
    );
    let container = &pod["containers"][0];
    assert_eq!(
        container["securityContext"]["readOnlyRootFilesystem"], true,
        "{what}"
    );
    assert_eq!(
        container["securityContext"]["allowPrivilegeEscalation"], false,
        "{what}"
    );
    assert!(
        container["resources"]["requests"]["memory"].is_string(),
        "{what}"
    );
    assert!(
        container["resources"]["limits"]["memory"].is_string(),
        "{what}"
    );
    for (variable, key) in [
        ("TOLLGATE_KEY_SECRET", "key-secret"),
        ("TOLLGATE_DATABASE_URL", "database-url"),
    ] {
        let env = container["env"]
            .as_sequence()
            .expect("env")
            .iter()
            .find(|e| e["name"] == variable)
            .unwrap_or_else(|| panic!("{what}: no {variable}"));
        assert_eq!(
            env["valueFrom"]["secretKeyRef"]["name"], "tollgate",
            "{what}"
        );
        assert_eq!(env["valueFrom"]["secretKeyRef"]["key"], key, "{what}");
        let secret = load("secret.example.yaml");
        assert!(
            secret["stringData"][key].is_string(),
            "the example Secret has no {key}"
        );
    }
    let args: Vec<&str> = container["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        &args[1..],
        ["--config", "/etc/tollgate/proxy.toml"],
        "{what}"
    );
    assert_eq!(
        container["volumeMounts"][0]["mountPath"], "/etc/tollgate",
        "{what}"
    );
    let volume = &pod["volumes"][0];
    assert_eq!(
        volume["name"], container["volumeMounts"][0]["name"],
        "{what}"
    );
    assert_eq!(volume["configMap"]["name"], "tollgate", "{what}");
}

#[test]
fn the_manifests_agree_with_the_configuration() {
    let (toml, _) = configmap_toml();
    let config: toml_edit::DocumentMut = toml.parse().expect("TOML");
    let shutdown = seconds(
        config["server"]["shutdown_timeout"]
            .as_str()
            .expect("shutdown"),
    );
    let http_port = port_of(config["server"]["listen"][0].as_str().expect("listen"));
    let admin_port = port_of(config["admin"]["listen"].as_str().expect("admin listen"));

    let deployment = load("deployment.yaml");
    assert_eq!(deployment["spec"]["replicas"], 3);
    let labels = &deployment["spec"]["selector"]["matchLabels"];
    assert_eq!(
        &deployment["spec"]["template"]["metadata"]["labels"],
        labels
    );
    let pod = &deployment["spec"]["template"]["spec"];
    check_pod("deployment", pod);
    let container = &pod["containers"][0];
    assert_eq!(args_of(container)[0], "run");
    assert_eq!(container_port(container, "http"), http_port);
    assert_eq!(container_port(container, "admin"), admin_port);
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        assert_eq!(container[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(container[probe]["httpGet"]["port"], "admin", "{probe}");
    }
    // The grace period includes the preStop hook: it must cover the sleep and the drain.
    let pre_stop = &container["lifecycle"]["preStop"]["exec"]["command"];
    assert_eq!(pre_stop[0], "sleep");
    let sleep: u64 = pre_stop[1]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("sleep N");
    let grace = pod["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("grace period");
    assert!(
        grace > sleep + shutdown,
        "terminationGracePeriodSeconds {grace} <= preStop {sleep} + shutdown_timeout {shutdown}"
    );

    let service = load("service.yaml");
    assert_eq!(&service["spec"]["selector"], labels);
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "http");

    let pdb = load("pdb.yaml");
    assert_eq!(&pdb["spec"]["selector"]["matchLabels"], labels);
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);

    let job = load("migrate-job.yaml");
    let job_pod = &job["spec"]["template"]["spec"];
    check_pod("migrate job", job_pod);
    assert_eq!(args_of(&job_pod["containers"][0])[0], "migrate");
    assert_eq!(job_pod["containers"][0]["image"], container["image"]);
    // The Job's pod must not carry the Deployment's labels, or the Service would route to it.
    let job_labels = &job["spec"]["template"]["metadata"]["labels"];
    assert_ne!(
        job_labels["app.kubernetes.io/name"],
        labels["app.kubernetes.io/name"]
    );
}

fn args_of(container: &Value) -> Vec<&str> {
    container["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect()
}
