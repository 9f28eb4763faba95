//! `tokenbucket-rls`: serve, or check a rules path (`check-config`).

use std::process::ExitCode;

use clap::Parser;
use tokenbucket_rls::cli::{Cli, Command};
use tokenbucket_rls::rules::{self, LoadOptions};
use tokenbucket_rls::telemetry::tracing;

/// mimalloc: per-thread free lists instead of glibc's arenas on the
/// request path (BENCHMARKS.md, CPU per decision).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::CheckConfig {
            path,
            merge_domains,
        }) => check_config(&path, merge_domains),
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

fn check_config(path: &std::path::Path, merge_domains: bool) -> ExitCode {
    let opts = LoadOptions { merge_domains };
    match rules::load_path(path, opts) {
        Ok(set) => {
            let files = set.files().len();
            let domains = set.domains().count();
            println!(
                "{}: valid ({files} file(s), {domains} domain(s))",
                path.display()
            );
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
