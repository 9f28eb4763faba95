//! A rule's `replication:` (docs/redis.md, "Failovers that lose nothing"):
//! how many replicas must hold an admission, and how long the primary waits
//! for them, each refusal with its reason.

use std::time::Duration;

use super::{limits_for, Scope};
use crate::replication::{Replication, MAX_REPLICAS, MAX_TIMEOUT};
use crate::rules::error::ConfigErrors;
use crate::rules::matcher::RuleAction;
use crate::rules::schema::DescriptorDoc;

/// The `timeout` of a `replication:` that does not say.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);

/// `replication:` checked: `Some(None)` when the rule has none, `None` (the
/// reason reported) when it cannot be honoured: no replica count, a timeout
/// that is not a positive duration of at most [`MAX_TIMEOUT`], a rule with
/// no bucket in Redis to replicate (unlimited, `concurrency`), or one that
/// spends elsewhere (`lease`, `scope: global`).
pub(super) fn compile_replication(
    scope: &Scope<'_>,
    doc: &DescriptorDoc,
    action: &Option<RuleAction>,
    errors: &mut ConfigErrors,
) -> Option<Option<Replication>> {
    let Some(r) = &doc.replication else {
        return Some(None);
    };
    limits_for(
        scope,
        doc,
        action,
        "`replication`",
        "no bucket in Redis to replicate",
        errors,
    )?;
    let mut ok = true;
    let mut refuse = |message: String| {
        scope.error(errors, message);
        ok = false;
    };
    let replicas = match r.replicas {
        None | Some(0) => {
            refuse("replication.replicas is missing or 0; give how many replicas must hold an admission, all of the primary's (e.g. `replication: {replicas: 2, timeout: 50ms}`)".into());
            0
        }
        Some(n) if n > MAX_REPLICAS => {
            refuse(format!(
                "replication.replicas {n} is more than {MAX_REPLICAS}; give the number of the primary's replicas"
            ));
            0
        }
        Some(n) => n,
    };
    let timeout = match r.timeout.as_deref() {
        None => DEFAULT_TIMEOUT,
        Some(raw) => match humantime::parse_duration(raw) {
            Ok(t) if t.is_zero() => {
                refuse(format!(
                    "replication.timeout '{raw}' is 0; Redis would wait for ever (give e.g. 50ms)"
                ));
                t
            }
            Ok(t) if t > MAX_TIMEOUT => {
                refuse(format!(
                    "replication.timeout '{raw}' is longer than {}: a decision waits for it on the request's path",
                    humantime::format_duration(MAX_TIMEOUT)
                ));
                t
            }
            Ok(t) => t,
            Err(e) => {
                refuse(format!(
                    "replication.timeout '{raw}' is not a duration ({e}); write e.g. 50ms"
                ));
                DEFAULT_TIMEOUT
            }
        },
    };
    if doc.lease.is_some() {
        refuse("`replication` and `lease` together: a lease spends its tokens in this process, where no replica holds them; use one or the other".into());
    }
    if doc.scope.as_deref() == Some("global") {
        refuse("`replication` with `scope: global`: a region spends its share of a global rule in its own memory; drop one".into());
    }
    ok.then_some(Some(Replication { replicas, timeout }))
}
