//! Reading rules from disk: a single file, or every `*.yaml`/`*.yml` in a
//! directory (symlinks followed, dot-entries such as Kubernetes' `..data`
//! skipped), parsed, checked across files for domains, then compiled.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::compile::compile_top_level;
use super::error::{ConfigError, ConfigErrors};
use super::matcher::Level;
use super::schema::RulesFile;
use super::watch::is_rule_file_name;
use super::wildcard::Wildcard;
use super::{Domain, LoadedFile, RuleSet};
use crate::bucket::Algorithm;

/// Knobs of one load.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// One domain may span several files (`--merge-domains`).
    pub merge_domains: bool,
    /// `--usage-domains`: in these domains a descriptor's own cost is a
    /// usage charge (see [`super::Rule::usage_charges`]).
    pub usage_domains: DomainPatterns,
    /// `--algorithm`: how a rule that names none counts.
    pub default_algorithm: crate::bucket::Algorithm,
    /// `--ratelimit-rules`: load what envoyproxy/ratelimit loads, saying in
    /// a warning what is ignored ([`RuleSet::warnings`]): a domain whose
    /// `descriptors:` is null or missing (no rules), `requests_per_unit`
    /// beside `unlimited: true` without a unit, YAML documents after a
    /// file's first.
    pub ratelimit_files: bool,
}

/// Domain names, exact or with `*` (any run of characters), e.g. `*` for
/// every domain or `default/eg/*`.
#[derive(Debug, Clone, Default)]
pub struct DomainPatterns(Arc<[(String, Option<Wildcard>)]>);

impl DomainPatterns {
    pub fn new<S: AsRef<str>>(patterns: &[S]) -> Self {
        Self(
            patterns
                .iter()
                .map(|p| p.as_ref().trim())
                .filter(|p| !p.is_empty())
                .map(|p| (p.to_string(), Wildcard::parse(p)))
                .collect(),
        )
    }

    pub fn matches(&self, domain: &str) -> bool {
        self.0.iter().any(|(exact, pattern)| match pattern {
            Some(w) => w.matches(domain),
            None => exact == domain,
        })
    }
}

/// The rule files a config path stands for, sorted by name.
pub fn rule_files(path: &Path) -> Result<Vec<PathBuf>, ConfigErrors> {
    let meta = fs::metadata(path).map_err(|e| one(path, format!("cannot read: {e}")))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let entries =
        fs::read_dir(path).map_err(|e| one(path, format!("cannot list directory: {e}")))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| one(path, format!("cannot list directory: {e}")))?;
        if !is_rule_file_name(&entry.file_name()) {
            continue;
        }
        let file = entry.path();
        // Follow symlinks (ConfigMap files are links through `..data`).
        if fs::metadata(&file).map(|m| m.is_file()).unwrap_or(false) {
            files.push(file);
        }
    }
    files.sort();
    Ok(files)
}

/// Loads and compiles every rule file under `path`.
pub fn load_path(path: &Path, opts: LoadOptions) -> Result<RuleSet, ConfigErrors> {
    let mut errors = ConfigErrors::default();
    let mut sources = Vec::new();
    for file in rule_files(path)? {
        match fs::read_to_string(&file) {
            Ok(text) => sources.push((file, text)),
            Err(e) => errors.push(ConfigError::new(&file, format!("cannot read: {e}"))),
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    load_sources(sources, opts)
}

/// Parses and compiles rule files given as (path, contents).
pub fn load_sources(
    sources: Vec<(PathBuf, String)>,
    opts: LoadOptions,
) -> Result<RuleSet, ConfigErrors> {
    let mut errors = ConfigErrors::default();
    let warnings = std::cell::RefCell::new(Vec::new());
    let parsed = parse_files(sources, &opts, &mut errors, &mut warnings.borrow_mut());

    // Group files by domain, in file order.
    let mut by_domain: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, file) in parsed.iter().enumerate() {
        let domain = file.doc.domain.as_deref().unwrap_or("");
        if domain.is_empty() {
            errors.push(ConfigError::new(
                &file.path,
                "`domain` is missing or empty; every rules file names its domain",
            ));
            continue;
        }
        match file.doc.descriptors {
            None | Some(None) if opts.ratelimit_files => warnings.borrow_mut().push(ConfigError::new(
                &file.path,
                format!("domain '{domain}': `descriptors` is null or missing; loaded with no rules, as envoyproxy/ratelimit loads it (write `descriptors: []` to say so)"),
            )),
            None => errors.push(ConfigError::new(
                &file.path,
                format!("domain '{domain}': `descriptors` is missing; list the domain's descriptors (or write `descriptors: []`)"),
            )),
            Some(None) => errors.push(ConfigError::new(
                &file.path,
                format!("domain '{domain}': `descriptors:` is empty, as in a file cut short; list the descriptors, or write `descriptors: []` for a domain with no rules"),
            )),
            Some(Some(_)) => {}
        }
        let files = by_domain.entry(domain.to_string()).or_default();
        if let (Some(&first), false) = (files.first(), opts.merge_domains) {
            // Said once; the file's descriptors are not compiled into the
            // other file's domain, which would repeat it once per clash.
            errors.push(ConfigError::new(
                &file.path,
                format!(
                    "domain '{domain}' is already defined in {}; a domain lives in one file unless --merge-domains is set",
                    parsed[first].path.display()
                ),
            ));
            continue;
        }
        files.push(i);
    }

    let mut domains = HashMap::new();
    for (name, files) in by_domain {
        let name: Arc<str> = Arc::from(name.as_str());
        let mut root = Level::default();
        let usage = opts.usage_domains.matches(&name);
        for &i in &files {
            let file = &parsed[i];
            if let Some(Some(docs)) = &file.doc.descriptors {
                compile_top_level(
                    &mut root,
                    &name,
                    (usage, opts.default_algorithm),
                    (&file.path, opts.ratelimit_files, &warnings),
                    docs,
                    &mut errors,
                );
            }
        }
        let attempt_keys = check_attempts(&root, &name, &parsed[files[0]].path, &mut errors);
        let files = files.iter().map(|&i| parsed[i].path.clone()).collect();
        domains.insert(
            name.to_string(),
            Domain {
                name,
                root,
                files,
                usage,
                attempt_keys,
                retired_attempts: Vec::new(),
                override_algorithm: match opts.default_algorithm {
                    Algorithm::FixedWindow => Algorithm::FixedWindow,
                    _ => Algorithm::TokenBucket,
                },
            },
        );
    }

    if errors.is_empty() {
        Ok(RuleSet {
            domains,
            files: parsed,
            generation: 0,
            in_force_since: 0,
            warnings: warnings.into_inner(),
        })
    } else {
        Err(errors)
    }
}

/// Step 1: each file's rules, parsed (its first YAML document only under
/// `--ratelimit-rules`); what does not parse is an error naming the file.
fn parse_files(
    sources: Vec<(PathBuf, String)>,
    opts: &LoadOptions,
    errors: &mut ConfigErrors,
    warnings: &mut Vec<ConfigError>,
) -> Vec<LoadedFile> {
    let mut parsed = Vec::new();
    for (path, text) in sources {
        let first = match opts.ratelimit_files {
            true => first_document(&path, &text, warnings),
            false => serde_yaml::from_str::<Option<RulesFile>>(&text),
        };
        match first {
            Ok(Some(doc)) => parsed.push(LoadedFile { path, doc }),
            // Rejected at start-up, by check-config and on reload alike: a
            // file caught mid-write, or an emptied ConfigMap key, looks so.
            Ok(None) => errors.push(ConfigError::new(
                &path,
                "the file holds no rules (it is empty, or only comments); give it a `domain:` and `descriptors:`, or remove it",
            )),
            // serde stops at the first error: say that the rest of the
            // file was not looked at (the other files still are)
            Err(e) => errors.push(ConfigError::new(
                &path,
                format!("invalid rules file: {e} (the first error only: the rest of this file is checked once it parses)"),
            )),
        }
    }
    parsed
}

/// A file's first YAML document, as envoyproxy/ratelimit's yaml.v2 reads
/// it; the documents after it are named in a warning.
fn first_document(
    path: &Path,
    text: &str,
    warnings: &mut Vec<ConfigError>,
) -> Result<Option<RulesFile>, serde_yaml::Error> {
    use serde::Deserialize;
    let mut documents = serde_yaml::Deserializer::from_str(text);
    let Some(first) = documents.next() else {
        return Ok(None);
    };
    let doc = Option::<RulesFile>::deserialize(first)?;
    let rest = documents.count();
    if rest > 0 {
        warnings.push(ConfigError::new(
            path,
            format!("{rest} YAML document(s) after the first are ignored, as envoyproxy/ratelimit reads only a file's first; put each domain in a file of its own"),
        ));
    }
    Ok(doc)
}

/// The entry keys that name attempts and their phase in a domain's rules
/// (skipped in matching, so never one of the tree's own keys), each
/// problem reported against `file` (the domain's first).
fn check_attempts(
    root: &Level,
    domain: &str,
    file: &Path,
    errors: &mut ConfigErrors,
) -> Vec<String> {
    let mut keys: Vec<String> = Vec::new();
    for rule in root.rules() {
        let Some(a) = &rule.attempts else { continue };
        for k in [&a.key, &a.phase_key] {
            if !keys.contains(k) {
                keys.push(k.clone());
            }
        }
    }
    if keys.is_empty() {
        return keys;
    }
    let tree = root.all_keys();
    for k in &keys {
        if tree.contains(k.as_str()) {
            errors.push(ConfigError::new(
                file,
                format!("domain '{domain}': '{k}' names attempts (attempts.key or phase_key) and is also a descriptor key of the domain; an attempt entry takes no part in matching, so give it a key of its own"),
            ));
        }
    }
    keys
}

fn one(path: &Path, message: String) -> ConfigErrors {
    ConfigErrors(vec![ConfigError::new(path, message)])
}
