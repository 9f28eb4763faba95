//! The compiled descriptor tree and its lookup.
//!
//! Each level maps a descriptor key to its branch: exact values in a hash map,
//! `*` patterns in file order, and the key-only default. A request descriptor
//! walks the tree entry by entry (exact, then patterns, then default) and the
//! node reached by its last entry decides: its rule applies, or none does.
//! A lookup is a couple of hash hits per entry plus the patterns of one key.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;

use super::unit::{FailureMode, Unit};
use super::wildcard::Wildcard;
use crate::bucket::{Algorithm, BucketParams};
use crate::calendar::CalendarPeriods;

fn metadata_as_yaml<S: serde::Serializer>(
    metadata: &Option<envoy_types::pb::google::protobuf::Struct>,
    s: S,
) -> Result<S::Ok, S::Error> {
    metadata
        .as_ref()
        .map(crate::pb_struct::yaml_from_struct)
        .serialize(s)
}

/// What a descriptor path leads to.
#[derive(Debug, Serialize)]
pub struct Rule {
    pub domain: Arc<str>,
    /// The descriptor path from the config (`tenant_acme.api_key`): the metric label
    /// when the rule has no name; never holds a raw request value.
    pub path: String,
    /// The descriptor keys of its path, in order.
    pub keys: Vec<String>,
    /// The keys of its path whose value is a `share_threshold` pattern, with
    /// the pattern: every value it matches spends the same bucket.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shared_values: Vec<(String, String)>,
    pub source: PathBuf,
    pub action: RuleAction,
    pub shadow_mode: bool,
    pub quota_mode: bool,
    pub detailed_metric: bool,
    pub value_to_metric: bool,
    /// Own or inherited from an enclosing descriptor; `None`: the server default.
    pub failure_mode: Option<FailureMode>,
    /// Spend through local leases of the shared bucket (`lease:`).
    pub lease: Option<LeaseConfig>,
    /// `overdraft:` a spend is a charge, never refused: its buckets may go
    /// into debt, down to minus their burst, which the refill repays.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub overdraft: bool,
    /// In one of `--usage-domains` (and able to take `overdraft`): a
    /// descriptor that brings its own `hits_addend` of 1 or more (Envoy's
    /// `RateLimit.hits_addend`, Envoy Gateway's `cost`) is charged as on
    /// an `overdraft` rule; one without spends as usual.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub usage_charges: bool,
    /// `metadata:` (a map), sent back in the response's dynamic metadata
    /// for a descriptor this rule passes, with `--response-dynamic-metadata`.
    /// Held as the `Struct` it is sent as (converted once, at load); shown
    /// at `/config` as YAML.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "metadata_as_yaml"
    )]
    pub metadata: Option<envoy_types::pb::google::protobuf::Struct>,
    /// `max_values:` at most this many distinct descriptors get buckets of
    /// their own; the others share the rule's overflow bucket.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_values: Option<u64>,
    /// `scope: global`: on a region (`--quota-upstream`), its buckets are
    /// spent within the share of the global budget the global tier gives
    /// this region ([`crate::quota::region`]); elsewhere an ordinary rule.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub global: bool,
    /// `attempts:`: the descriptor entry that identifies an attempt, and
    /// what the rule does with it ([`crate::attempt`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempts: Option<AttemptsConfig>,
    /// `replication:` (Redis store): an admission is answered once this many
    /// replicas hold it ([`crate::replication`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replication: Option<crate::replication::Replication>,
    /// Counted on Redis as envoyproxy/ratelimit counts, in its keys: a
    /// fixed window of one limit, with nothing that service does not have
    /// (`attempts`, `replication`, `max_values`); see
    /// [`Rule::counts_in_ratelimit_keys`].
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub ratelimit_keys: bool,
    /// (domain, [`Rule::label`]) as a small id, for what stores count per bucket.
    #[serde(skip)]
    pub id: crate::labels::RuleId,
}

/// A rule's `attempts:`: which descriptor entries name the attempt and its
/// phase (they take no part in matching or in the bucket's key), how long
/// an attempt is remembered, and what its calls do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AttemptsConfig {
    /// The entry whose value is the attempt id (`x-request-id`).
    pub key: String,
    /// The entry whose value `done` marks the call made when the stream is
    /// done (absent, or any other value: the request-time call).
    pub phase_key: String,
    #[serde(serialize_with = "as_humantime")]
    pub ttl: std::time::Duration,
    /// On an `overdraft` rule: what a start reserves when its descriptor
    /// brings no `hits_addend` of its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserve: Option<u64>,
    pub mode: crate::attempt::AttemptMode,
    /// How often a live attempt's start is answered as a repeat; past it,
    /// refused (counted `reused`).
    pub max_repeats: u32,
}

/// A rule's `lease:`: each instance takes up to `size` tokens from the shared
/// bucket in one store call and spends them locally; tokens unspent after
/// `ttl` go back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LeaseConfig {
    pub size: u64,
    #[serde(serialize_with = "as_humantime")]
    pub ttl: std::time::Duration,
}

fn as_humantime<S: serde::Serializer>(d: &std::time::Duration, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_duration(*d))
}

impl Rule {
    /// Whether a rule counts on Redis in envoyproxy/ratelimit's keys and
    /// operations (`INCRBY` + `EXPIRE` in `prefix`, `domain_key_value_…_`
    /// and the window's start): a fixed window of exactly one limit (its
    /// keys have no limit's name in them), and none of what that service
    /// has no key for: `attempts` (a record beside the count),
    /// `replication` (a `WAIT` after a script), `max_values` (an overflow
    /// bucket of its own).
    pub fn counts_in_ratelimit_keys(&self) -> bool {
        let one_fixed_window = matches!(&self.action, RuleAction::Limited(limits)
            if limits.len() == 1
                && limits[0].algorithm == crate::bucket::Algorithm::FixedWindow
                && limits[0].calendar.is_none());
        one_fixed_window
            && self.attempts.is_none()
            && self.replication.is_none()
            && self.max_values.is_none()
            && self.lease.is_none()
            && !self.global
    }

    /// The label used for this rule in metrics: its (first) limit's name, else its path.
    pub fn label(&self) -> &str {
        match &self.action {
            RuleAction::Limited(limits) => limits
                .iter()
                .find_map(|l| l.name.as_deref())
                .unwrap_or(&self.path),
            RuleAction::Unlimited { name, .. } => name.as_deref().unwrap_or(&self.path),
            RuleAction::Concurrency { .. } => &self.path,
        }
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleAction {
    Unlimited {
        name: Option<String>,
        /// Limits this rule replaces when it matches, as a limited rule's do
        /// (envoyproxy/ratelimit honours `replaces` on unlimited rules too).
        replaces: Vec<String>,
    },
    /// One bucket per limit; all must admit (a single `rate_limit` is one limit).
    Limited(Vec<Limit>),
    /// `concurrency: N`: at most `max` attempts in flight per descriptor
    /// (slots, [`crate::attempt::take_slot`]), no bucket.
    Concurrency { max: u32 },
}

/// One bucket's definition.
#[derive(Debug, Clone, Serialize)]
pub struct Limit {
    pub name: Option<String>,
    pub unit: Unit,
    /// The window is this many units (1: one unit).
    #[serde(skip_serializing_if = "is_one")]
    pub unit_multiplier: u32,
    /// The window's length in seconds (unit × unit_multiplier).
    pub window_secs: u64,
    /// How it counts (the rule's `algorithm`).
    #[serde(serialize_with = "algorithm_name")]
    pub algorithm: Algorithm,
    pub requests_per_unit: u32,
    pub burst: u32,
    pub replaces: Vec<String>,
    /// Tells this bucket apart from the rule's other buckets in the store key.
    pub bucket_id: String,
    /// The rule's `max_debt` (shown at `/config`; the arithmetic reads it
    /// from `params`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_debt: Option<u64>,
    /// A calendar period's (`calendar:`): its zone and anchor, and the
    /// periods it last found.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "calendar_words"
    )]
    pub calendar: Option<Arc<CalendarPeriods>>,
    #[serde(skip)]
    pub params: BucketParams,
}

fn calendar_words<S: serde::Serializer>(
    c: &Option<Arc<CalendarPeriods>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match c {
        Some(c) => s.collect_str(c.calendar()),
        None => s.serialize_none(),
    }
}

impl Limit {
    pub fn new(
        name: Option<String>,
        unit: Unit,
        requests_per_unit: u32,
        burst: u32,
        replaces: Vec<String>,
        bucket_id: String,
    ) -> Self {
        Self {
            params: BucketParams {
                capacity: u64::from(burst),
                tokens_per_unit: u64::from(requests_per_unit),
                unit_secs: unit.seconds(),
                max_debt: None,
                algorithm: Algorithm::TokenBucket,
                period: None,
            },
            name,
            unit,
            unit_multiplier: 1,
            window_secs: unit.seconds(),
            algorithm: Algorithm::TokenBucket,
            requests_per_unit,
            burst,
            replaces,
            bucket_id,
            max_debt: None,
            calendar: None,
        }
    }

    /// The same limit counted in `calendar`'s periods (a budget a period),
    /// with bucket ids of its own.
    pub fn with_calendar(mut self, calendar: Arc<CalendarPeriods>) -> Self {
        self.params.algorithm = Algorithm::CalendarWindow;
        self.algorithm = Algorithm::CalendarWindow;
        self.bucket_id.push_str("~calendar");
        self.calendar = Some(calendar);
        self
    }

    /// The bucket's parameters for a decision at `unix_secs` by the
    /// calendar's clock, which reads `offset_secs` ahead of the stores'
    /// (`--calendar-clock-offset`): a calendar period's carry the period
    /// holding that moment and the next, as the stores' clocks see them.
    pub fn params_at(&self, unix_secs: i64, offset_secs: i64) -> BucketParams {
        match &self.calendar {
            None => self.params,
            Some(c) => BucketParams {
                period: Some(c.periods_at(unix_secs).earlier_by(offset_secs)),
                ..self.params
            },
        }
    }

    /// The same limit over a window of `multiplier` units.
    pub fn with_multiplier(mut self, multiplier: u32) -> Self {
        self.unit_multiplier = multiplier;
        self.window_secs = self.unit.seconds() * u64::from(multiplier);
        self.params.unit_secs = self.window_secs;
        self
    }
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

fn algorithm_name<S: serde::Serializer>(a: &Algorithm, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(a.name())
}

/// One level of the tree: the descriptors at one depth under one parent.
#[derive(Debug, Default)]
pub struct Level {
    pub(super) keys: HashMap<String, KeyBranch>,
}

#[derive(Debug, Default)]
pub(super) struct KeyBranch {
    pub(super) exact: HashMap<String, Node>,
    pub(super) wildcards: Vec<WildcardNode>,
    pub(super) default: Option<Node>,
}

impl KeyBranch {
    /// The node `value` reaches, as [`Level::lookup`] chooses it: its exact
    /// value, else the first wildcard it matches, else the key's default.
    fn node_for(&self, value: &str) -> Option<&Node> {
        self.exact
            .get(value)
            .or_else(|| {
                self.wildcards
                    .iter()
                    .find(|w| w.pattern.matches(value))
                    .map(|w| &w.node)
            })
            .or(self.default.as_ref())
    }
}

/// Steps an RLQS bucket id's search for its order may take at most
/// ([`Level::order_entries`]).
pub const MAX_ORDER_STEPS: usize = 4096;

#[derive(Debug)]
pub(super) struct WildcardNode {
    pub(super) pattern: Wildcard,
    pub(super) share_threshold: bool,
    pub(super) node: Node,
}

#[derive(Debug, Default)]
pub(super) struct Node {
    pub(super) rule: Option<Arc<Rule>>,
    pub(super) children: Level,
}

/// A request descriptor entry, as the matcher sees it.
pub trait DescriptorEntry {
    fn key(&self) -> &str;
    fn value(&self) -> &str;
}

impl DescriptorEntry for (&str, &str) {
    fn key(&self) -> &str {
        self.0
    }
    fn value(&self) -> &str {
        self.1
    }
}

/// How one request entry contributes to the bucket's identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketValue<'a> {
    /// The request's own value: one bucket per distinct value.
    Value(&'a str),
    /// A `share_threshold` pattern: every matching value shares one bucket.
    Shared(&'a str),
}

/// The rule a descriptor reached, and what names its bucket.
#[derive(Debug)]
pub struct Match<'a> {
    pub rule: &'a Arc<Rule>,
    pub values: Vec<BucketValue<'a>>,
}

impl Level {
    /// Walks `entries` down the tree; `None` when no rule applies.
    pub fn lookup<'a, E: DescriptorEntry>(&'a self, entries: &'a [E]) -> Option<Match<'a>> {
        self.lookup_skipping(entries, &[])
    }

    /// [`Level::lookup`], passing over the entries whose key is one of
    /// `skip` (a domain's attempt entries: they take no part in matching).
    pub fn lookup_skipping<'a, E: DescriptorEntry>(
        &'a self,
        entries: &'a [E],
        skip: &[String],
    ) -> Option<Match<'a>> {
        let mut level = self;
        let mut values = Vec::with_capacity(entries.len());
        let mut reached = None;
        for entry in entries {
            if !skip.is_empty() && skip.iter().any(|k| k == entry.key()) {
                continue;
            }
            let branch = level.keys.get(entry.key())?;
            let value = entry.value();
            // a value that was not UTF-8 (or held a NUL) comes marked by a
            // NUL in front (service::wire): its bucket is its own, but it
            // is matched as its text reads, `*` patterns included
            let text = value.strip_prefix('\0').unwrap_or(value);
            let node = if let Some(node) = branch.exact.get(text) {
                values.push(BucketValue::Value(value));
                node
            } else if let Some(w) = branch.wildcards.iter().find(|w| w.pattern.matches(text)) {
                values.push(if w.share_threshold {
                    BucketValue::Shared(w.pattern.pattern())
                } else {
                    BucketValue::Value(value)
                });
                &w.node
            } else {
                values.push(BucketValue::Value(value));
                branch.default.as_ref()?
            };
            reached = Some(node);
            level = &node.children;
        }
        let rule = reached?.rule.as_ref()?;
        Some(Match { rule, values })
    }

    /// Orders an unordered set of entries (an RLQS `bucket_id`) as the
    /// descriptor path down this tree that reaches a rule, as
    /// `ShouldRateLimit` would with that path: the first such order found
    /// trying, at each level, the entries whose key the level has in sorted
    /// order (so the answer is the same whatever order the id came in), and
    /// backtracking where a choice leads to no rule. When no order reaches
    /// one, the greedy walk's order (which reaches none). The search stops
    /// after [`MAX_ORDER_STEPS`] steps (an id is at most 32 entries; a tree
    /// that branches on several of them at every level is the worst case).
    pub fn order_entries<'a>(&self, entries: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
        let mut left: Vec<(&'a str, &'a str)> = entries.to_vec();
        left.sort_unstable();
        let mut path = Vec::with_capacity(left.len());
        let mut steps = MAX_ORDER_STEPS;
        if self.search(self, &mut left, &mut path, &mut steps) {
            return path;
        }
        self.greedy_order(entries)
    }

    /// Depth-first search for [`Level::order_entries`]: extends `path` with
    /// the entries `left`, walking from `self` (a level under `root`).
    fn search<'a>(
        &self,
        root: &Level,
        left: &mut Vec<(&'a str, &'a str)>,
        path: &mut Vec<(&'a str, &'a str)>,
        steps: &mut usize,
    ) -> bool {
        if left.is_empty() {
            return root.lookup(path.as_slice()).is_some();
        }
        for i in 0..left.len() {
            if *steps == 0 {
                return false;
            }
            *steps -= 1;
            let (key, value) = left[i];
            let Some(node) = self.keys.get(key).and_then(|b| b.node_for(value)) else {
                continue;
            };
            left.remove(i);
            path.push((key, value));
            if node.children.search(root, left, path, steps) {
                return true;
            }
            path.pop();
            left.insert(i, (key, value));
        }
        false
    }

    /// The walk that takes, at each level, the first entry (by key) the
    /// level has: what `order_entries` answers when no order reaches a rule.
    fn greedy_order<'a>(&self, entries: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
        let mut left: Vec<(&'a str, &'a str)> = entries.to_vec();
        left.sort_unstable();
        let mut path = Vec::with_capacity(left.len());
        let mut level = self;
        while let Some(i) = left.iter().position(|(k, _)| level.keys.contains_key(*k)) {
            let (key, value) = left.remove(i);
            path.push((key, value));
            match level.keys.get(key).and_then(|b| b.node_for(value)) {
                Some(node) => level = &node.children,
                None => break,
            }
        }
        path.extend(left);
        path
    }

    /// Every rule in the tree, depth first in file order of keys' first appearance.
    /// Every descriptor key of the tree, at any depth.
    pub fn all_keys(&self) -> HashSet<&str> {
        let mut out = HashSet::new();
        let mut levels = vec![self];
        while let Some(level) = levels.pop() {
            for (key, branch) in &level.keys {
                out.insert(key.as_str());
                let nodes = branch
                    .exact
                    .values()
                    .chain(branch.wildcards.iter().map(|w| &w.node))
                    .chain(branch.default.iter());
                levels.extend(nodes.map(|n| &n.children));
            }
        }
        out
    }

    pub fn rules(&self) -> Vec<&Arc<Rule>> {
        let mut out = Vec::new();
        self.collect(&mut out);
        out
    }

    fn collect<'a>(&'a self, out: &mut Vec<&'a Arc<Rule>>) {
        for branch in self.keys.values() {
            let nodes = branch
                .exact
                .values()
                .chain(branch.wildcards.iter().map(|w| &w.node))
                .chain(branch.default.iter());
            for node in nodes {
                if let Some(rule) = &node.rule {
                    out.push(rule);
                }
                node.children.collect(out);
            }
        }
    }
}

#[cfg(test)]
impl Level {
    /// For every node with a rule, a descriptor path reaching it in the
    /// tree (exact values as they are, a wildcard's `*` as `x`, a key's
    /// default as `any`), for tests that walk every rule.
    pub(crate) fn example_paths(&self) -> Vec<Vec<(String, String)>> {
        let mut out = Vec::new();
        self.collect_paths(&mut Vec::new(), &mut out);
        out
    }

    fn collect_paths(
        &self,
        prefix: &mut Vec<(String, String)>,
        out: &mut Vec<Vec<(String, String)>>,
    ) {
        for (key, branch) in &self.keys {
            let mut nodes: Vec<(String, &Node)> =
                branch.exact.iter().map(|(v, n)| (v.clone(), n)).collect();
            for w in &branch.wildcards {
                let value = w.pattern.pattern().replace('*', "x");
                if w.pattern.matches(&value) {
                    nodes.push((value, &w.node));
                }
            }
            if let Some(n) = &branch.default {
                nodes.push(("any".to_string(), n));
            }
            for (value, node) in nodes {
                prefix.push((key.clone(), value));
                if node.rule.is_some() {
                    out.push(prefix.clone());
                }
                node.children.collect_paths(prefix, out);
                prefix.pop();
            }
        }
    }
}
