//! Fuzz the configuration loader: arbitrary text must give a config or a list of problems, never a
//! panic, and every listed problem must carry a message.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match pare::config::Config::from_yaml(text) {
        Ok(config) => assert!(config.validate().is_empty()),
        Err(err) => {
            assert!(!err.problems.is_empty());
            assert!(err.problems.iter().all(|p| !p.message.is_empty()));
        }
    }
});
