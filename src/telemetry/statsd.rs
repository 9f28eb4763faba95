//! envoyproxy/ratelimit's per-rule statistics sent over statsd
//! (`--statsd-addr`, or its `USE_STATSD=true` with `STATSD_HOST` and
//! `STATSD_PORT`): the counters of [`super::ratelimit_stats`] under its
//! statsd names, `ratelimit.service.rate_limit.<domain>.<path>.<stat>`,
//! where `<path>` is the rule's descriptor path (`key_value.key2`, as there
//! without `detailed_metric`'s request values). Hits are summed in memory
//! and sent as statsd counters (`name:n|c`) once per flush interval, in UDP
//! packets of at most [`MAX_PACKET`] bytes; a send that fails is counted in
//! `rls_statsd_send_errors_total` and dropped (statsd is lossy by design).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use parking_lot::Mutex;

/// The stats one rule has, in [`STAT_NAMES`] order.
pub type RuleHits = [u64; STAT_NAMES.len()];

pub const STAT_NAMES: [&str; 5] = [
    "total_hits",
    "within_limit",
    "near_limit",
    "over_limit",
    "shadow_mode",
];

/// Payload bytes per UDP packet: fits an Ethernet MTU with IP and UDP headers.
pub const MAX_PACKET: usize = 1432;

/// Hits not yet sent, by domain then rule path.
#[derive(Default)]
pub struct StatsdCounters {
    pending: Mutex<HashMap<String, HashMap<String, RuleHits>>>,
}

impl StatsdCounters {
    /// Adds `hits` to the stats of (`domain`, `path`) that `which` marks.
    pub fn add(
        &self,
        domain: &str,
        path: &str,
        which: [bool; STAT_NAMES.len()],
        amounts: [u64; STAT_NAMES.len()],
    ) {
        let mut pending = self.pending.lock();
        // no allocation once the rule has been seen
        let rules = match pending.get_mut(domain) {
            Some(rules) => rules,
            None => pending.entry(domain.to_string()).or_default(),
        };
        let counts = match rules.get_mut(path) {
            Some(counts) => counts,
            None => rules.entry(path.to_string()).or_default(),
        };
        for ((count, on), n) in counts.iter_mut().zip(which).zip(amounts) {
            if on {
                // saturating, as the limiter does (`hits_addend` near 2^64)
                *count = count.saturating_add(n);
            }
        }
    }

    /// Everything pending as statsd lines, the counts set back to nothing.
    pub fn drain_lines(&self) -> Vec<String> {
        let pending = std::mem::take(&mut *self.pending.lock());
        let mut lines = Vec::new();
        for (domain, rules) in pending {
            for (path, counts) in rules {
                for (stat, n) in STAT_NAMES.iter().zip(counts) {
                    if n > 0 {
                        lines.push(format!(
                            "ratelimit.service.rate_limit.{}.{}.{stat}:{n}|c",
                            sanitize(&domain),
                            sanitize(&path)
                        ));
                    }
                }
            }
        }
        lines.sort();
        lines
    }
}

/// What statsd's line format cannot carry (`:` `|` `@` and line breaks)
/// becomes `_`, as envoyproxy/ratelimit does with `:` and `|`.
fn sanitize(name: &str) -> std::borrow::Cow<'_, str> {
    if name.contains([':', '|', '@', '\n', '\r']) {
        name.replace([':', '|', '@', '\n', '\r'], "_").into()
    } else {
        name.into()
    }
}

/// `lines` joined by newlines into packets of at most `max` bytes (a line
/// longer than that goes alone).
pub fn packets(lines: &[String], max: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut current = String::new();
    for line in lines {
        if !current.is_empty() && current.len() + 1 + line.len() > max {
            out.push(std::mem::take(&mut current));
        }
        if !current.is_empty() {
            current.push('\n');
        }
        current.push_str(line);
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// Sends what `counters` gathered to `target` (`HOST:PORT`) every
/// `interval`, until the process ends. The name is resolved at each flush,
/// as a UDP sink does: while it does not resolve (DNS not ready yet, a
/// collector not deployed yet), that flush's packets are dropped, counted
/// in `send_errors` and logged once, and the service serves on.
pub async fn flush_every(
    counters: std::sync::Arc<StatsdCounters>,
    target: String,
    interval: Duration,
    send_errors: prometheus::IntCounter,
) -> anyhow::Result<()> {
    let mut socket: Option<(tokio::net::UdpSocket, bool)> = None;
    let mut unresolved = false;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let packets = packets(&counters.drain_lines(), MAX_PACKET);
        if packets.is_empty() {
            continue;
        }
        let resolved = tokio::net::lookup_host(target.as_str())
            .await
            .ok()
            .and_then(|mut addrs| addrs.next());
        let Some(addr) = resolved else {
            send_errors.inc_by(packets.len() as u64);
            if !unresolved {
                tracing::warn!(%target, "statsd host does not resolve: stats dropped until it does");
                unresolved = true;
            }
            continue;
        };
        if unresolved {
            tracing::info!(%target, %addr, "statsd host resolves again");
            unresolved = false;
        }
        if socket.as_ref().is_none_or(|(_, v4)| *v4 != addr.is_ipv4()) {
            let bind: SocketAddr = if addr.is_ipv4() {
                ([0, 0, 0, 0], 0).into()
            } else {
                (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
            };
            socket = Some((tokio::net::UdpSocket::bind(bind).await?, addr.is_ipv4()));
        }
        let Some((udp, _)) = &socket else { continue };
        for packet in packets {
            if let Err(e) = udp.send_to(packet.as_bytes(), addr).await {
                send_errors.inc();
                tracing::debug!(%target, error = %e, "statsd packet not sent");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_are_summed_per_rule_and_drained_once() {
        let c = StatsdCounters::default();
        let ok = [true, true, false, false, false];
        let over = [true, false, false, true, false];
        c.add("edge", "path_/login", ok, [1; STAT_NAMES.len()]);
        c.add("edge", "path_/login", ok, [2; STAT_NAMES.len()]);
        c.add("edge", "path_/login", over, [5; STAT_NAMES.len()]);
        c.add("a:b", "k|v", ok, [1; STAT_NAMES.len()]);
        assert_eq!(
            c.drain_lines(),
            [
                "ratelimit.service.rate_limit.a_b.k_v.total_hits:1|c",
                "ratelimit.service.rate_limit.a_b.k_v.within_limit:1|c",
                "ratelimit.service.rate_limit.edge.path_/login.over_limit:5|c",
                "ratelimit.service.rate_limit.edge.path_/login.total_hits:8|c",
                "ratelimit.service.rate_limit.edge.path_/login.within_limit:3|c",
            ]
        );
        assert!(c.drain_lines().is_empty(), "sent once");
    }

    /// `hits_addend` near 2^64 saturates the count instead of wrapping.
    #[test]
    fn counts_saturate() {
        let c = StatsdCounters::default();
        let ok = [true, true, false, false, false];
        c.add("edge", "k", ok, [2; STAT_NAMES.len()]);
        c.add("edge", "k", ok, [u64::MAX - 1; STAT_NAMES.len()]);
        assert_eq!(
            c.drain_lines()[0],
            format!(
                "ratelimit.service.rate_limit.edge.k.total_hits:{}|c",
                u64::MAX
            )
        );
    }

    #[test]
    fn packets_stay_under_the_limit() {
        let lines: Vec<String> = (0..100).map(|i| format!("stat.{i}:1|c")).collect();
        let out = packets(&lines, 100);
        assert!(out.iter().all(|p| p.len() <= 100), "{out:?}");
        let back: Vec<&str> = out.iter().flat_map(|p| p.split('\n')).collect();
        assert_eq!(back, lines.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(
            packets(&["x".repeat(200)], 100).len(),
            1,
            "a long line alone"
        );
    }
}
