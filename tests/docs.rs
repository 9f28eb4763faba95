//! The documentation kept true (#42): every relative link and anchor in
//! the Markdown files resolves, and the configuration table (`docs/run.md`) and
//! the binary's `--help` name the same flags and `RLS_*` variables.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The Markdown files the project ships: the top level's and `docs/`'s.
fn markdown_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in [Path::new(ROOT).to_path_buf(), Path::new(ROOT).join("docs")] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// GitHub's anchor for a heading: lower case, punctuation dropped (but
/// `-` and `_`), spaces as `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown text's headings (outside code blocks), with
/// GitHub's `-1`, `-2` for repeats.
fn anchors(text: &str) -> HashSet<String> {
    let mut seen: std::collections::HashMap<String, usize> = Default::default();
    let mut out = HashSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let base = slug(line.trim_start_matches('#'));
        let n = seen.entry(base.clone()).or_default();
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// The targets of a text's inline links `[..](target)` outside code
/// blocks, with their line numbers.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push((n + 1, after[..end].to_string()));
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let files = markdown_files();
    assert!(files.iter().any(|f| f.ends_with("README.md")), "{files:?}");
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read");
        for (line, target) in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let resolved = if path.is_empty() {
                file.clone()
            } else {
                file.parent().expect("dir").join(path)
            };
            if !resolved.exists() {
                broken.push(format!("{}:{line}: {target}: no such file", file.display()));
                continue;
            }
            if let Some(anchor) = anchor {
                let target_text = std::fs::read_to_string(&resolved).unwrap_or_default();
                if !anchors(&target_text).contains(anchor) {
                    broken.push(format!(
                        "{}:{line}: {target}: no such heading",
                        file.display()
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked > 0, "no relative link checked");
}

#[test]
fn the_anchor_rule_is_githubs() {
    assert_eq!(
        slug(" Attempts: reservations, and retries charged once"),
        "attempts-reservations-and-retries-charged-once"
    );
    assert_eq!(
        slug("2026-12-05: CPU per decision (#38)"),
        "2026-12-05-cpu-per-decision-38"
    );
    let a = anchors("# A\n## A\n```\n# not a heading\n```\n### B c\n");
    assert!(
        a.contains("a") && a.contains("a-1") && a.contains("b-c"),
        "{a:?}"
    );
    assert!(!a.contains("not-a-heading"));
}

/// The "Configuration" section of `docs/run.md`.
fn configuration_table() -> String {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("docs/run.md")).expect("docs/run.md");
    let start = readme
        .find("## Configuration\n")
        .expect("a Configuration section");
    let end = readme[start + 5..]
        .find("\n## ")
        .map_or(readme.len(), |e| start + 5 + e);
    readme[start..end].to_string()
}

fn words(text: &str, prefix: &str, more: impl Fn(char) -> bool) -> HashSet<String> {
    let mut out = HashSet::new();
    let mut rest = text;
    while let Some(i) = rest.find(prefix) {
        let tail = &rest[i + prefix.len()..];
        let len = tail.find(|c: char| !more(c)).unwrap_or(tail.len());
        if len > 0 {
            out.insert(format!("{prefix}{}", &tail[..len]));
        }
        rest = &tail[len..];
    }
    out
}

#[test]
fn the_configuration_table_and_help_name_the_same_flags_and_variables() {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
        .arg("--help")
        .output()
        .expect("run --help");
    let help = String::from_utf8_lossy(&out.stdout).to_string();
    let table = configuration_table();
    let flag_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    let env_char = |c: char| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_';
    let help_flags: HashSet<String> = words(&help, "--", flag_char)
        .into_iter()
        .filter(|f| f != "--help" && f != "--version" && f.len() > 3)
        .collect();
    let help_envs = words(&help, "RLS_", env_char);
    assert!(help_flags.len() > 30 && help_envs.len() > 30, "{help}");
    let table_flags: HashSet<String> = words(&table, "`--", flag_char)
        .into_iter()
        .map(|f| f.trim_start_matches('`').to_string())
        .collect();
    let table_envs = words(&table, "RLS_", env_char);
    let mut missing: Vec<_> = help_flags
        .difference(&table_flags)
        .chain(help_envs.difference(&table_envs))
        .collect();
    missing.sort();
    assert!(
        missing.is_empty(),
        "in --help, not in docs/run.md's Configuration table: {missing:?}"
    );
    let mut stale: Vec<_> = table_flags
        .difference(&help_flags)
        .chain(table_envs.difference(&help_envs))
        .collect();
    stale.sort();
    assert!(
        stale.is_empty(),
        "in docs/run.md's Configuration table, not in --help: {stale:?}"
    );
}
