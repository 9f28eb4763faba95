//! Small ids for (domain, rule) label pairs.
//!
//! A store keeps one per bucket, two bytes, so that what it does to a bucket
//! without a request in hand (evicting it) can still be counted by the rule
//! it belongs to. Ids are handed out once per pair for the life of the
//! process (pairs are bounded by the rules ever loaded) and turned back into
//! labels by telemetry.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): a
//! leaf: uses nothing of the crate.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::RwLock;

/// A (domain, rule) label pair's id. `RuleId::default()` is ("", "unknown").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RuleId(u16);

/// The pairs, and the id of each.
struct Registry {
    labels: Vec<(Arc<str>, Arc<str>)>,
    /// domain → rule → id (nested, so that a lookup borrows its `&str`s)
    ids: HashMap<Arc<str>, HashMap<Arc<str>, RuleId>>,
}

fn registry() -> &'static RwLock<Registry> {
    static REGISTRY: OnceLock<RwLock<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        RwLock::new(Registry {
            labels: vec![(Arc::from(""), Arc::from("unknown"))],
            ids: HashMap::new(),
        })
    })
}

impl RuleId {
    /// The id of (`domain`, `rule`), the same for every call with them.
    pub fn of(domain: &str, rule: &str) -> Self {
        let find = |r: &Registry| r.ids.get(domain).and_then(|m| m.get(rule)).copied();
        if let Some(id) = find(&registry().read()) {
            return id;
        }
        let mut registry = registry().write();
        if let Some(id) = find(&registry) {
            return id;
        }
        // Bounded by the rules ever loaded; past 65,535 pairs, "unknown".
        let Ok(id) = u16::try_from(registry.labels.len()) else {
            return RuleId::default();
        };
        let id = RuleId(id);
        let (domain, rule): (Arc<str>, Arc<str>) = (Arc::from(domain), Arc::from(rule));
        registry.labels.push((domain.clone(), rule.clone()));
        registry.ids.entry(domain).or_default().insert(rule, id);
        id
    }

    /// A dense index (0 for the default), for tables by rule.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    /// The id at dense index `i`, if one was handed out.
    pub fn from_index(i: usize) -> Option<Self> {
        let n = registry().read().labels.len();
        (i < n).then(|| RuleId(u16::try_from(i).unwrap_or(0)))
    }

    /// The (domain, rule) labels of this id.
    pub fn labels(self) -> (Arc<str>, Arc<str>) {
        let registry = registry().read();
        registry
            .labels
            .get(self.0 as usize)
            .unwrap_or(&registry.labels[0])
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_id_per_pair_and_back() {
        let a = RuleId::of("edge", "per_key");
        let b = RuleId::of("edge", "per_ip");
        assert_ne!(a, b);
        assert_eq!(RuleId::of("edge", "per_key"), a);
        assert_eq!(a.labels(), (Arc::from("edge"), Arc::from("per_key")));
        assert_eq!(RuleId::default().labels().1.as_ref(), "unknown");
    }
}
