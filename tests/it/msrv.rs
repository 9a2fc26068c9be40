//! `.ci/msrv-check`: Cargo.toml's `rust-version` covers every locked dependency, and the check
//! really fails when one needs more (fed crafted `cargo metadata` JSON), so CI cannot pass by a
//! script that never says no.

use crate::common::repo;
use std::path::PathBuf;
use std::process::{Command, Output};

fn msrv_check(args: &[&str]) -> Output {
    Command::new("python3")
        .arg(repo(".ci/msrv-check"))
        .args(args)
        .current_dir(repo(""))
        .output()
        .unwrap_or_else(|e| {
            panic!("python3 is needed to run .ci/msrv-check ({e}); install python3")
        })
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Metadata with the workspace package at `declared` and one dependency at `needs`.
fn crafted(name: &str, declared: &str, needs: &str) -> PathBuf {
    let meta = serde_json::json!({
        "packages": [
            {"id": "path+file:///src#tollgate@0.1.0", "name": "tollgate", "version": "0.1.0",
             "rust_version": declared},
            {"id": "registry+https://github.com/rust-lang/crates.io-index#futuristic@9.9.9",
             "name": "futuristic", "version": "9.9.9", "rust_version": needs},
            {"id": "registry+https://github.com/rust-lang/crates.io-index#old@1.0.0",
             "name": "old", "version": "1.0.0", "rust_version": null},
        ],
        "workspace_members": ["path+file:///src#tollgate@0.1.0"],
    });
    let dir = std::env::temp_dir().join(format!("tollgate-msrv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, meta.to_string()).expect("write metadata");
    path
}

#[test]
fn locked_dependencies_fit_the_declared_rust_version_and_the_readme_agrees() {
    let out = msrv_check(&["--readme", "README.md"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("rust-version 1.88"), "{}", text(&out));
}

#[test]
fn a_dependency_needing_a_newer_rust_fails_the_check() {
    let path = crafted("too-new", "1.88", "1.99");
    let out = msrv_check(&["--metadata", path.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("futuristic 9.9.9 needs Rust 1.99"),
        "{}",
        text(&out)
    );
}

#[test]
fn a_patch_level_requirement_counts() {
    let path = crafted("patch", "1.88", "1.88.1");
    let out = msrv_check(&["--metadata", path.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("needs Rust 1.88.1"), "{}", text(&out));
}

#[test]
fn dependencies_at_or_below_the_declared_version_pass() {
    let path = crafted("fits", "1.88", "1.88.0");
    let out = msrv_check(&["--metadata", path.to_str().expect("utf-8 path")]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn a_readme_naming_another_version_fails_the_check() {
    let path = crafted("readme", "1.88", "1.80");
    let readme = path.with_file_name("README.md");
    std::fs::write(
        &readme,
        "You need a Rust toolchain (1.82 or newer) and a C compiler.\n",
    )
    .expect("write readme");
    let out = msrv_check(&[
        "--metadata",
        path.to_str().expect("utf-8 path"),
        "--readme",
        readme.to_str().expect("utf-8 path"),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("says Rust 1.82"), "{}", text(&out));
}

#[test]
fn unreadable_metadata_is_an_error_not_a_pass() {
    let path = crafted("broken", "1.88", "1.0");
    std::fs::write(&path, "{not json").expect("write");
    let out = msrv_check(&["--metadata", path.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}
