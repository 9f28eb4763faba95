//! envoyproxy/ratelimit's decision replayed against a real Redis, as its
//! source defines it, for tests that alternate calls between it and our
//! binary the way a rolling update does (#68): its keys
//! (`src/limiter/cache_key.go`: prefix, `domain_`, `key_value_` per entry,
//! the window's start), its operations (`src/redis/fixed_cache_impl.go`:
//! `GET` first under `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`, then
//! `INCRBY key hits-or-0` and `EXPIRE key <unit + jitter>`), its
//! descriptor statuses (`src/limiter/base_limiter.go`) and its overall
//! code (`src/service/ratelimit.go`: any regular limit over, or every
//! quota-mode one). The rules' matching is not replayed: each call names
//! the limit its rules give the descriptor (or the override it carries).

use std::time::{SystemTime, UNIX_EPOCH};

/// The limit a descriptor meets there: `requests_per_unit` per `unit_secs`
/// (`UnitToDivider`), and the rule's modes.
#[derive(Debug, Clone, Copy)]
pub struct PeerLimit {
    pub requests_per_unit: u64,
    pub unit_secs: u64,
    pub quota_mode: bool,
    pub shadow_mode: bool,
}

impl PeerLimit {
    pub fn per(requests_per_unit: u64, unit_secs: u64) -> Self {
        Self {
            requests_per_unit,
            unit_secs,
            quota_mode: false,
            shadow_mode: false,
        }
    }

    pub fn quota(self) -> Self {
        Self {
            quota_mode: true,
            ..self
        }
    }
}

/// One descriptor of a call: its entries (the values its key is made of:
/// a `share_threshold` pattern in place of a value, as there) and the
/// limit it meets (`None`: no rule).
#[derive(Debug, Clone)]
pub struct PeerDescriptor {
    pub entries: Vec<(String, String)>,
    pub limit: Option<PeerLimit>,
}

impl PeerDescriptor {
    pub fn new(entries: &[(&str, &str)], limit: Option<PeerLimit>) -> Self {
        Self {
            entries: entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            limit,
        }
    }
}

/// What it answered: the overall code (true: OVER_LIMIT) and each
/// descriptor's (over, limit_remaining).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerAnswer {
    pub over: bool,
    pub statuses: Vec<(bool, u64)>,
}

/// One envoyproxy/ratelimit pod's settings that change what it writes.
pub struct Peer<'a> {
    /// `CACHE_KEY_PREFIX`.
    pub prefix: &'a str,
    /// `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`.
    pub stop_increment: bool,
    /// `QUOTA_MODE`.
    pub quota_mode: bool,
    /// `redis-cli` against the Redis holding the keys (`-c` on a cluster).
    pub cli: &'a dyn Fn(&[&str]) -> String,
}

impl<'a> Peer<'a> {
    /// A pod with `prefix` on the Redis `cli` reaches, its settings at
    /// their defaults (`STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT` and
    /// `QUOTA_MODE` off).
    pub fn on(prefix: &'a str, cli: &'a dyn Fn(&[&str]) -> String) -> Self {
        Self {
            prefix,
            stop_increment: false,
            quota_mode: false,
            cli,
        }
    }

    /// The same, with `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true`.
    pub fn stopping(self) -> Self {
        Self {
            stop_increment: true,
            ..self
        }
    }

    /// Its key for `d` at `now` (Unix seconds), as `GenerateCacheKey`.
    pub fn key(&self, domain: &str, d: &PeerDescriptor, now: u64) -> Option<String> {
        let limit = d.limit?;
        let mut key = format!("{}{domain}_", self.prefix);
        for (k, v) in &d.entries {
            key.push_str(&format!("{k}_{v}_"));
        }
        let divider = limit.unit_secs;
        key.push_str(&(now / divider * divider).to_string());
        Some(key)
    }

    /// One `ShouldRateLimit` call of `hits` hits, decided as there.
    pub fn call(&self, domain: &str, descriptors: &[PeerDescriptor], hits: u64) -> PeerAnswer {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_secs();
        let keys: Vec<Option<String>> = descriptors
            .iter()
            .map(|d| self.key(domain, d, now))
            .collect();
        // STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT: the counts first; when
        // any descriptor would go over, only those count the hits
        let mut would_be_over = vec![false; descriptors.len()];
        if self.stop_increment {
            for (i, (d, key)) in descriptors.iter().zip(&keys).enumerate() {
                if let (Some(key), Some(limit)) = (key, d.limit) {
                    let count: u64 = (self.cli)(&["GET", key]).trim().parse().unwrap_or(0);
                    would_be_over[i] = count + hits > limit.requests_per_unit;
                }
            }
        }
        let any_over = would_be_over.iter().any(|o| *o);
        let mut statuses = Vec::new();
        let (mut regular_over, mut quota_total, mut quota_over) = (false, 0, 0);
        for (i, (d, key)) in descriptors.iter().zip(&keys).enumerate() {
            let (Some(key), Some(limit)) = (key, d.limit) else {
                statuses.push((false, 0));
                quota_total += usize::from(self.quota_mode);
                continue;
            };
            let by = match (self.stop_increment && any_over, would_be_over[i]) {
                (true, false) => 0,
                _ => hits,
            };
            let after: u64 = (self.cli)(&["INCRBY", key, &by.to_string()])
                .trim()
                .parse()
                .expect("INCRBY's count");
            let _ = (self.cli)(&["EXPIRE", key, &limit.unit_secs.to_string()]);
            let over = after > limit.requests_per_unit;
            let shown_over = over && !limit.shadow_mode;
            let remaining = if over {
                0
            } else {
                limit.requests_per_unit - after
            };
            statuses.push((shown_over, remaining));
            let quota = self.quota_mode || limit.quota_mode;
            match (shown_over, quota) {
                (true, true) => quota_over += 1,
                (true, false) => regular_over = true,
                _ => {}
            }
            quota_total += usize::from(quota);
        }
        PeerAnswer {
            over: regular_over || (quota_total > 0 && quota_total == quota_over),
            statuses,
        }
    }
}

/// The start of the current hour (Unix seconds), once at least 20 s of it
/// are left: a test's calls all fall in that window.
pub async fn hour_with_room() -> u64 {
    loop {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_secs();
        if 3600 - now % 3600 > 20 {
            return now - now % 3600;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}
