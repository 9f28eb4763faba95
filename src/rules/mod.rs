//! Rules: the YAML format, its validation, the compiled matcher, and loading.
//!
//! The request path asks a [`RuleSet`] which rule a descriptor reaches
//! ([`RuleSet::lookup`]); everything else here exists to build one from files
//! and to explain, file by file, why a file cannot be used.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `decision`; uses only leaves (`bucket`, `labels`, `pb_struct`);
//! where rules come from (`sources`) sits above `telemetry`.

mod compile;
pub mod error;
pub mod loader;
pub mod matcher;
pub mod schema;
pub mod unit;
pub mod watch;
pub mod wildcard;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;

pub use error::{ConfigError, ConfigErrors};
pub use loader::{load_path, load_sources, rule_files, DomainPatterns, LoadOptions};
pub use matcher::{
    AttemptsConfig, BucketValue, DescriptorEntry, LeaseConfig, Limit, Match, Rule, RuleAction,
};
pub use unit::{FailureMode, Unit};

/// One domain's compiled tree and where it came from.
#[derive(Debug)]
pub struct Domain {
    pub name: Arc<str>,
    pub(crate) root: matcher::Level,
    pub files: Vec<PathBuf>,
    /// One of `--usage-domains`: descriptors' own costs are charges.
    pub usage: bool,
    /// The entry keys its rules' `attempts:` name (attempt ids and
    /// phases): passed over in matching and in bucket keys.
    pub attempt_keys: Vec<String>,
}

/// A parsed rules file, kept for `/config`.
#[derive(Debug, Serialize)]
pub struct LoadedFile {
    pub path: PathBuf,
    #[serde(flatten)]
    pub doc: schema::RulesFile,
}

/// Entries of one descriptor (or RLQS bucket id), and bytes of one of its
/// keys or values (or a domain), at most: what a request may ask the rules
/// to match.
pub const MAX_ENTRIES: usize = 32;
pub const MAX_KEY_OR_VALUE_BYTES: usize = 1024;

/// The rules in force, swapped whole on reload: the handle every reader
/// holds (the services, readiness, reloads, xDS, a region's client).
pub type SharedRules = Arc<arc_swap::ArcSwap<RuleSet>>;

/// Every loaded domain: an immutable snapshot, swapped whole on reload.
#[derive(Debug, Default)]
pub struct RuleSet {
    domains: HashMap<String, Domain>,
    files: Vec<LoadedFile>,
    generation: u64,
}

impl RuleSet {
    /// The rule `entries` reach in `domain`, if any.
    pub fn lookup<'a, E: DescriptorEntry>(
        &'a self,
        domain: &str,
        entries: &'a [E],
    ) -> Option<Match<'a>> {
        let domain = self.domains.get(domain)?;
        domain.root.lookup_skipping(entries, &domain.attempt_keys)
    }

    /// The entry keys that name attempts in `domain` (empty: none).
    pub fn attempt_keys(&self, domain: &str) -> &[String] {
        self.domains
            .get(domain)
            .map_or(&[], |d| d.attempt_keys.as_slice())
    }

    /// An RLQS `bucket_id` (unordered) as a descriptor path of `domain`
    /// (see [`matcher::Level::order_entries`]); `None` for an unknown domain.
    pub fn quota_path<'a>(
        &self,
        domain: &str,
        bucket: &[(&'a str, &'a str)],
    ) -> Option<Vec<(&'a str, &'a str)>> {
        Some(self.domains.get(domain)?.root.order_entries(bucket))
    }

    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// Whether `domain` is one of `--usage-domains`.
    pub fn is_usage_domain(&self, domain: &str) -> bool {
        self.domains.get(domain).is_some_and(|d| d.usage)
    }

    pub fn domains(&self) -> impl Iterator<Item = &Domain> {
        self.domains.values()
    }

    pub fn files(&self) -> &[LoadedFile] {
        &self.files
    }

    /// `domain: rule` of every rule with `attempts:`, sorted.
    pub fn attempt_rules(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .domains
            .values()
            .flat_map(|d| {
                d.root
                    .rules()
                    .into_iter()
                    .filter(|r| r.attempts.is_some())
                    .map(move |r| format!("{}: {}", d.name, r.label()))
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Every compiled rule of a domain.
    pub fn rules(&self, domain: &str) -> Vec<&Arc<Rule>> {
        self.domains
            .get(domain)
            .map(|d| d.root.rules())
            .unwrap_or_default()
    }

    /// Counts loads: 1 for the first, +1 for each reload that was applied.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn with_generation(mut self, generation: u64) -> Self {
        self.generation = generation;
        self
    }
}

#[cfg(test)]
mod tests;
