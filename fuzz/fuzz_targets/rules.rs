//! Arbitrary bytes as a rules file: the parser, validator and compiler must
//! answer (rules or errors naming the file), never panic; whatever loads must
//! answer lookups built from the same bytes.
#![no_main]

use std::path::PathBuf;

use libfuzzer_sys::fuzz_target;
use tokenbucket_rls::rules::{load_sources, LoadOptions};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data).into_owned();
    let opts = LoadOptions {
        merge_domains: data.first().is_some_and(|b| b & 1 == 1),
        usage_domains: tokenbucket_rls::rules::DomainPatterns::new(&["*"]),
        // bits 2 and 4 of the first byte: token bucket, fixed, sliding
        default_algorithm: tokenbucket_rls::bucket::Algorithm::ALL
            [usize::from(data.first().map_or(0, |b| (b >> 1) & 3)) % 3],
        // bit 8: as envoyproxy/ratelimit loads files
        ratelimit_files: data.first().is_some_and(|b| b & 0x80 != 0),
    };
    match load_sources(vec![(PathBuf::from("fuzz.yaml"), text.clone())], opts) {
        Ok(rules) => {
            // Lookups from words of the input: every level, wildcards included.
            let words: Vec<&str> = text.split_whitespace().take(16).collect();
            let entries: Vec<(&str, &str)> = words.chunks(2).map(|w| (w[0], w.get(1).copied().unwrap_or(""))).collect();
            for domain in rules.domains().map(|d| d.name.to_string()).collect::<Vec<_>>() {
                for n in 0..=entries.len() {
                    let _ = rules.lookup(&domain, &entries[..n]);
                }
            }
        }
        Err(errors) => {
            assert!(!errors.is_empty());
            for e in errors.iter() {
                assert!(e.to_string().starts_with("fuzz.yaml: "), "{e}");
            }
        }
    }
});
