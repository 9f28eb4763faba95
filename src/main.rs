//! `tokenbucket-rls`: serve, or check a rules path (`check-config`).

use std::process::ExitCode;

use clap::Parser;
use tokenbucket_rls::cli::{Cli, Command};
use tokenbucket_rls::rules::{self, LoadOptions};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::CheckConfig {
            path,
            merge_domains,
        }) => check_config(&path, merge_domains),
        None => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
                )
                .init();
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(tokenbucket_rls::server::run(cli.serve)) {
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
    let opts = LoadOptions {
        merge_domains,
        allow_empty_files: true,
    };
    match rules::load_path(path, opts) {
        Ok(set) => {
            let files = set.files().len();
            let domains = set.domains().count();
            println!(
                "{}: valid ({files} file(s), {domains} domain(s))",
                path.display()
            );
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
