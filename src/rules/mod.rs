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

use std::collections::{HashMap, HashSet};
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
    /// The `attempts:` of rules a reload took it from, kept while their
    /// records may still be settled ([`RuleSet::succeeding`]).
    pub retired_attempts: Vec<RetiredAttempts>,
    /// How a request's `limit` override counts: `--algorithm` (a fixed
    /// window in envoyproxy/ratelimit's key under its environment, else a
    /// token bucket).
    pub override_algorithm: crate::bucket::Algorithm,
}

impl Domain {
    /// The rule matching `entries` (its attempt entries passed over).
    pub fn lookup<'a, E: DescriptorEntry>(&'a self, entries: &'a [E]) -> Option<Match<'a>> {
        self.root.lookup_skipping(entries, &self.attempt_keys)
    }

    /// The `attempts:` a reload removed from the rule at `path`, while its
    /// records may still be settled at `now_ms`.
    pub fn retired_attempts(&self, path: &str, now_ms: u64) -> Option<&AttemptsConfig> {
        self.retired_attempts
            .iter()
            .find(|r| r.rule_path == path && r.until_ms > now_ms)
            .map(|r| &r.config)
    }
}

/// A rule's `attempts:` that a reload removed (the rule gone, or without
/// it now): its done calls still settle from their records until
/// `until_ms` (Unix ms: two `ttl`s after the reload, as long as a record
/// lives), so that a reservation in flight comes back as it was used.
#[derive(Debug, Clone)]
pub struct RetiredAttempts {
    pub rule_path: String,
    pub config: AttemptsConfig,
    pub until_ms: u64,
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

/// A request's value as a key or an id holds it: itself, or, past
/// [`MAX_KEY_OR_VALUE_BYTES`], `sha1:` and the 40 hex digits of its
/// digest. Matching never sees this: rules match the whole value.
pub fn bounded_value(value: &str) -> std::borrow::Cow<'_, str> {
    if value.len() <= MAX_KEY_OR_VALUE_BYTES {
        return std::borrow::Cow::Borrowed(value);
    }
    std::borrow::Cow::Owned(format!("sha1:{}", sha1_smol::Sha1::from(value).digest()))
}

/// The rules in force, swapped whole on reload: the handle every reader
/// holds (the services, readiness, reloads, xDS, a region's client).
pub type SharedRules = Arc<arc_swap::ArcSwap<RuleSet>>;

/// Every loaded domain: an immutable snapshot, swapped whole on reload.
#[derive(Debug, Default)]
pub struct RuleSet {
    domains: HashMap<String, Domain>,
    files: Vec<LoadedFile>,
    generation: u64,
    /// When this generation was put in force (Unix seconds; 0: not yet).
    in_force_since: u64,
    /// What the load passed over (`--ratelimit-rules`), to be said.
    warnings: Vec<error::ConfigError>,
}

impl RuleSet {
    /// What loading these rules passed over, as envoyproxy/ratelimit does
    /// (`--ratelimit-rules`): for the log and `check-config`.
    pub fn warnings(&self) -> &[error::ConfigError] {
        &self.warnings
    }

    /// Logs [`Self::warnings`], one line each, at every load that has them.
    pub fn say_warnings(&self) {
        for w in &self.warnings {
            tracing::warn!(file = %w.file.display(), "rules loaded as envoyproxy/ratelimit loads them: {}", w.message);
        }
    }

    /// The rule `entries` reach in `domain`, if any.
    pub fn lookup<'a, E: DescriptorEntry>(
        &'a self,
        domain: &str,
        entries: &'a [E],
    ) -> Option<Match<'a>> {
        self.domains.get(domain)?.lookup(entries)
    }

    /// `domain`'s rules, looked up once for all of a call's descriptors.
    pub fn domain(&self, domain: &str) -> Option<&Domain> {
        self.domains.get(domain)
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

    /// This set, succeeding `previous` at `now_ms` (Unix ms): the
    /// `attempts:` of every rule of `previous` that lost them (and of every
    /// retired one still live) are kept as [`RetiredAttempts`], their keys
    /// passed over in matching as before, unless this set's tree matches
    /// on them.
    pub fn succeeding(mut self, previous: &RuleSet, now_ms: u64) -> Self {
        for (name, domain) in self.domains.iter_mut() {
            let Some(old) = previous.domains.get(name) else {
                continue;
            };
            let current: HashSet<String> = domain
                .root
                .rules()
                .into_iter()
                .filter(|r| r.attempts.is_some())
                .map(|r| r.path.clone())
                .collect();
            let lost = old
                .root
                .rules()
                .into_iter()
                .filter_map(|r| Some((r.path.clone(), r.attempts.clone()?)))
                .filter(|(path, _)| !current.contains(path))
                .map(|(rule_path, config)| RetiredAttempts {
                    until_ms: now_ms.saturating_add(
                        u64::try_from(config.ttl.as_millis())
                            .unwrap_or(u64::MAX)
                            .saturating_mul(2),
                    ),
                    rule_path,
                    config,
                });
            let still = old
                .retired_attempts
                .iter()
                .filter(|r| r.until_ms > now_ms && !current.contains(&r.rule_path))
                .cloned();
            let tree = domain.root.all_keys();
            for retired in lost.chain(still) {
                let keys = [&retired.config.key, &retired.config.phase_key];
                if keys.iter().any(|k| tree.contains(k.as_str())) {
                    continue; // the new tree matches on them
                }
                for k in keys {
                    if !domain.attempt_keys.contains(k) {
                        domain.attempt_keys.push(k.clone());
                    }
                }
                if !domain
                    .retired_attempts
                    .iter()
                    .any(|r| r.rule_path == retired.rule_path)
                {
                    domain.retired_attempts.push(retired);
                }
            }
        }
        self
    }

    /// The retired `attempts:` of `domain`'s rule at `path`, live at
    /// `now_ms` (Unix ms).
    pub fn retired_attempts(
        &self,
        domain: &str,
        path: &str,
        now_ms: u64,
    ) -> Option<&AttemptsConfig> {
        self.domains.get(domain)?.retired_attempts(path, now_ms)
    }

    /// Counts loads: 1 for the first, +1 for each reload that was applied.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// When this generation was put in force (Unix seconds; 0: not yet).
    pub fn in_force_since(&self) -> u64 {
        self.in_force_since
    }

    /// The set as generation `generation`, in force from now.
    pub fn with_generation(mut self, generation: u64) -> Self {
        self.generation = generation;
        self.in_force_since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self
    }
}

#[cfg(test)]
mod tests;
