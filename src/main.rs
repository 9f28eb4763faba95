//! `tokenbucket-rls`: serve, or check a rules path (`check-config`).

use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use tokenbucket_rls::cli::{ratelimit_env, Cli, Command};
use tokenbucket_rls::quota::{expired_behavior, rule_notes, Policy};
use tokenbucket_rls::rules::{self, LoadOptions};
use tokenbucket_rls::telemetry::tracing;

/// mimalloc: per-thread free lists instead of glibc's arenas on the
/// request path (BENCHMARKS.md, CPU per decision).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // envoyproxy/ratelimit's environment, as RLS_* where not set (flags
    // still win): before any thread exists, so setting variables is safe
    let env: std::collections::BTreeMap<String, String> = std::env::vars().collect();
    let from_ratelimit = match ratelimit_env::translate(&env) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    // the variables set from theirs, to name theirs in an error
    let mut translated = Vec::new();
    for (name, value) in &from_ratelimit.settings {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
            translated.push(*name);
        }
    }
    let matches = match Cli::command().try_get_matches() {
        Ok(m) => m,
        Err(e) => {
            if let Some(text) = ratelimit_env::name_their_variable(&e, &translated, &env) {
                eprintln!("error: {text}");
                return ExitCode::FAILURE;
            }
            e.exit()
        }
    };
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // flags win: an explicit --config over CONFIG_TYPE=GRPC_XDS_SOTW
    let xds_from_theirs = translated.contains(&"RLS_XDS_SERVER")
        && matches.value_source("xds_server") != Some(ValueSource::CommandLine);
    let config_flag = matches.value_source("config") == Some(ValueSource::CommandLine);
    let xds_overruled = xds_from_theirs && config_flag;
    if xds_overruled {
        cli.serve.xds_server = None;
    }
    match cli.command {
        Some(Command::CheckConfig {
            path,
            merge_domains,
            algorithm,
            ratelimit_rules,
            rlqs,
        }) => check_config(&path, (merge_domains, ratelimit_rules), algorithm, rlqs),
        Some(Command::Inspect {
            admin,
            redis_url,
            config,
            redis_key_prefix,
            redis_password_file,
            algorithm,
            domain,
            descriptor,
            reset,
            token_file,
            operator,
        }) => {
            let answer = match (&redis_url, &config) {
                (Some(redis_url), Some(config)) => {
                    let ask = tokenbucket_rls::cli::inspect::OnRedis {
                        redis_url,
                        config,
                        key_prefix: &redis_key_prefix,
                        password_file: redis_password_file.as_deref(),
                        algorithm,
                        domain: &domain,
                        descriptor: &descriptor,
                        reset,
                        operator: operator.as_deref(),
                    };
                    match tokio::runtime::Runtime::new() {
                        Ok(rt) => rt.block_on(tokenbucket_rls::cli::inspect::on_redis(&ask)),
                        Err(e) => Err(format!("cannot start the async runtime: {e}")),
                    }
                }
                _ => tokenbucket_rls::cli::inspect::run(&tokenbucket_rls::cli::inspect::Inspect {
                    admin: &admin,
                    domain: &domain,
                    descriptor: &descriptor,
                    reset,
                    token_file: token_file.as_deref(),
                    operator: operator.as_deref(),
                }),
            };
            match answer {
                Ok((status, body)) => {
                    println!("{}", body.trim_end());
                    if (200..300).contains(&status) {
                        ExitCode::SUCCESS
                    } else {
                        eprintln!("error: the service answered {status}");
                        ExitCode::FAILURE
                    }
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        None => {
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let result = runtime.block_on(async {
                let _tracing =
                    tracing::init(cli.serve.log_format, cli.serve.otlp_endpoint.as_deref())?;
                if xds_overruled {
                    ::tracing::info!(
                        config = %cli.serve.config.display(),
                        "--config given: rules come from it, not over xDS (CONFIG_TYPE=GRPC_XDS_SOTW in the environment)"
                    );
                }
                if !from_ratelimit.unused.is_empty() {
                    ::tracing::info!(
                        settings = %from_ratelimit.unused.join("; "),
                        "envoyproxy/ratelimit settings that change nothing here"
                    );
                }
                tokenbucket_rls::server::run(cli.serve).await
            });
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// Every rule with its domain, domains and then paths in order.
fn sorted_rules(
    set: &tokenbucket_rls::rules::RuleSet,
) -> Vec<(&str, &std::sync::Arc<tokenbucket_rls::rules::Rule>)> {
    let mut domains: Vec<&str> = set.domains().map(|d| &*d.name).collect();
    domains.sort_unstable();
    domains
        .into_iter()
        .flat_map(|domain| {
            let mut rules = set.rules(domain);
            rules.sort_by(|a, b| a.path.cmp(&b.path));
            rules.into_iter().map(move |rule| (domain, rule))
        })
        .collect()
}

/// One line per rule with `attempts:` (docs/usage.md, "Attempts"): what its calls
/// do, and the entries that carry the attempt and its phase.
fn print_attempts(set: &tokenbucket_rls::rules::RuleSet) {
    use tokenbucket_rls::attempt::AttemptMode;
    for (domain, rule) in sorted_rules(set) {
        let Some(a) = &rule.attempts else { continue };
        let what = match (a.mode, &rule.action) {
            (_, tokenbucket_rls::rules::RuleAction::Concurrency { max }) => format!(
                "at most {max} in flight per value: a start takes a slot, the done call releases it, a slot not released returns after {}",
                humantime::format_duration(a.ttl)
            ),
            (AttemptMode::Reserve, _) => format!(
                "reservations: a start reserves {}, refused unless held; the done call settles the difference; unsettled after {}: kept as spent",
                a.reserve.map_or_else(|| "its own hits_addend".to_string(), |n| format!("its own hits_addend, else {n}")),
                humantime::format_duration(a.ttl)
            ),
            _ => format!(
                "dedupe: a repeat of an admitted call is answered OK and charged nothing, for {}",
                humantime::format_duration(a.ttl)
            ),
        };
        println!(
            "attempts: domain {domain}, rule {}: {what} (attempt entry '{}', done when '{}' is 'done')",
            rule.path, a.key, a.phase_key
        );
    }
}

/// One line per rule with `replication:` (docs/redis.md, "Failovers that
/// lose nothing"): what an admission waits for, and what the memory store
/// does with it.
fn print_replication(set: &tokenbucket_rls::rules::RuleSet) {
    for (domain, rule) in sorted_rules(set) {
        let Some(r) = &rule.replication else { continue };
        println!(
            "replication: domain {domain}, rule {}: an admission is answered once {} replica(s) of the Redis primary hold it (WAIT, up to {}; then the rule's failure mode); the memory store decides it as any other",
            rule.path,
            r.replicas,
            humantime::format_duration(r.timeout)
        );
    }
}

/// One line per calendar limit (docs/rules.md, "Calendar periods"): its
/// period, and the one running now.
fn print_calendars(set: &tokenbucket_rls::rules::RuleSet) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    for (domain, rule) in sorted_rules(set) {
        let tokenbucket_rls::rules::RuleAction::Limited(limits) = &rule.action else {
            continue;
        };
        for l in limits {
            let Some(periods) = &l.calendar else { continue };
            let c = periods.calendar();
            let p = c.periods_at(now);
            println!(
                "calendar: domain {domain}, rule {}: {} {c}, admitted hits and charges counted; now from {} to {}",
                rule.path,
                l.requests_per_unit,
                c.show(p.start),
                c.show(p.end)
            );
        }
    }
}

/// One line per rule: its bucket id keys, what RLQS assigns, and notes.
fn print_rlqs(set: &tokenbucket_rls::rules::RuleSet) {
    for (domain, rule) in sorted_rules(set) {
        let assignment = match Policy::of_rule(rule) {
            Policy::AllowAll => "ALLOW_ALL".to_string(),
            Policy::DenyAll => "DENY_ALL".to_string(),
            Policy::Shared(b) => format!(
                "split between Envoys: burst {}, {}/s",
                b.burst,
                short(b.rate)
            ),
        };
        println!(
            "rlqs: domain {domain}, bucket_id keys {{{}}} -> {}: {assignment}",
            rule.keys.join(", "),
            rule.path
        );
        println!(
            "rlqs:   expired_assignment_behavior: {}",
            expired_behavior(rule)
        );
        for note in rule_notes(rule) {
            println!("rlqs:   note: {note}");
        }
    }
}

/// A rate with at most three decimals.
fn short(rate: f64) -> String {
    let text = format!("{rate:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn check_config(
    path: &std::path::Path,
    (merge_domains, ratelimit_files): (bool, bool),
    algorithm: tokenbucket_rls::bucket::Algorithm,
    rlqs: bool,
) -> ExitCode {
    let opts = LoadOptions {
        merge_domains,
        default_algorithm: algorithm,
        ratelimit_files,
        ..LoadOptions::default()
    };
    match rules::load_path(path, opts) {
        Ok(set) => {
            for w in set.warnings() {
                eprintln!("warning: {w}");
            }
            let files = set.files().len();
            let domains = set.domains().count();
            println!(
                "{}: valid ({files} file(s), {domains} domain(s))",
                path.display()
            );
            print_attempts(&set);
            print_replication(&set);
            print_calendars(&set);
            if rlqs {
                print_rlqs(&set);
            }
            if files == 0 {
                eprintln!(
                    "warning: {} holds no rule files: a server starts on it answering OK to every request, and a reload to it from loaded rules is rejected",
                    path.display()
                );
            }
            ExitCode::SUCCESS
        }
        Err(errors) => {
            for e in errors.iter() {
                println!("{e}");
            }
            ExitCode::FAILURE
        }
    }
}
