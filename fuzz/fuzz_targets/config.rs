//! Fuzzing of the configuration loader (src/config/load.rs): any text, valid UTF-8 or not,
//! loads or is refused with diagnostics; it never panics, never overflows the stack; a refusal
//! always has a reason, and each diagnostic's position is inside the text it was given.
//!
//! The unit test `no_panic_on_truncated_or_odd_input` runs a sample of the same idea on every
//! `cargo test`; this target is the exhaustive version, seeded with proxy.toml.example.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Every `${NAME}` resolves, so the fuzzer reaches the checks past substitution.
    let env = |_: &str| Some("fuzz".to_string());
    if let Err(errors) = tollgate::testing::config::load_str(Path::new("fuzz.toml"), text, &env) {
        let lines = text.lines().count().max(1);
        assert!(!errors.0.is_empty(), "a refusal without a reason: {text:?}");
        for error in &errors.0 {
            // Line 0 is "no position" (for example TOLLGATE_DATABASE_URL); a position is
            // inside the text (one past the last line for a problem at the end of it).
            assert!(error.line <= lines + 1, "{error:?} in {text:?}");
            assert_eq!(error.line == 0, error.col == 0, "{error:?}");
        }
    }
});
