//! The layers of `src/` point down, and stay so: this reads every source
//! file's paths into the crate (`crate::…`, `super::…`, outside comments
//! and test modules) and fails on an import against the order written in
//! `docs/architecture.md` ([`ROOMS`], top first), or on a cycle between
//! modules, naming the file and line. An exception is an [`ALLOWED`] entry
//! with its reason. Cheap: no build of anything, only the text.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The rooms, top first: a module may use its own room's and the rooms
/// below it. Modules are named by their path under `src/` (`store` holds
/// `store::redis::pipe`; the longest name that fits decides, so the rule
/// rooms such as `store::redis` could be told apart). Leaves share the last room.
const ROOMS: &[&[&str]] = &[
    &["main"],
    &["server"],
    &["admin", "health"],
    &["cli"],
    &["serving"],
    &["service"],
    &["limiter"],
    &["quota"],
    &["store"],
    &["sources"],
    &["telemetry"],
    &["decision"],
    &["rules"],
    &["tls"],
    &[
        "attempt",
        "background",
        "bucket",
        "calendar",
        "clock",
        "connection_bounds",
        "hitters",
        "instances",
        "labels",
        "pb_struct",
        "periodic",
        "replication",
        "shown",
        "window",
    ],
];

/// Imports against the order, or edges of a cycle, that stay for a reason:
/// (from module, to module, why).
const ALLOWED: &[(&str, &str, &str)] = &[];

/// A path into the crate found in a file: the module it names (as far as
/// modules go) and the line.
struct Use {
    to: String,
    line: usize,
}

/// Every source module of the library and the binary: its name and file.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                // test files and the benchmark binary are not layered
                let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                if name != "tests" && name != "bin" {
                    stack.push(path);
                }
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let mut parts: Vec<String> = rel
                .with_extension("")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "tests") {
                continue;
            }
            if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
                parts.pop();
            }
            // the library's root only declares the modules
            if !parts.is_empty() {
                out.insert(parts.join("::"), path);
            }
        }
    }
    out
}

/// The text of `path` without comments and `#[cfg(test)]` modules, line by
/// line (numbers kept).
fn code_lines(path: &Path) -> Vec<(usize, String)> {
    let text = std::fs::read_to_string(path).expect("read source");
    let mut out = Vec::new();
    let mut test_depth: Option<i64> = None;
    let mut cfg_test = false;
    for (i, raw) in text.lines().enumerate() {
        let line = match raw.find("//") {
            Some(at) => &raw[..at],
            None => raw,
        };
        let trimmed = line.trim();
        if let Some(depth) = test_depth.as_mut() {
            *depth += braces(line);
            if *depth <= 0 {
                test_depth = None;
            }
            continue;
        }
        if trimmed == "#[cfg(test)]" {
            cfg_test = true;
            continue;
        }
        if cfg_test && trimmed.starts_with("mod ") {
            cfg_test = false;
            if trimmed.ends_with(';') {
                continue;
            }
            let depth = braces(line);
            if depth > 0 {
                test_depth = Some(depth);
            }
            continue;
        }
        cfg_test = false;
        out.push((i + 1, line.to_string()));
    }
    out
}

fn braces(line: &str) -> i64 {
    line.chars()
        .map(|c| match c {
            '{' => 1,
            '}' => -1,
            _ => 0,
        })
        .sum()
}

/// The modules `module` (in `path`) names, with their lines: the longest
/// known module each `crate::`/`super::` path starts with.
fn uses(module: &str, path: &Path, known: &BTreeMap<String, PathBuf>) -> Vec<Use> {
    let mut out = Vec::new();
    for (line, text) in code_lines(path) {
        for (prefix, base) in [("crate::", Vec::new()), ("super::", parent(module))] {
            let mut rest = text.as_str();
            while let Some(at) = rest.find(prefix) {
                let before = rest[..at].chars().last();
                rest = &rest[at + prefix.len()..];
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                    continue;
                }
                let mut parts = base.clone();
                parts.extend(
                    rest.split("::")
                        .map(|p| {
                            p.chars()
                                .take_while(|c| c.is_alphanumeric() || *c == '_')
                                .collect::<String>()
                        })
                        .take_while(|p| !p.is_empty()),
                );
                if let Some(to) = longest_known(&parts, known) {
                    if to != module && !to.is_empty() {
                        out.push(Use { to, line });
                    }
                }
            }
        }
    }
    out
}

/// The module `super` names from `module` (`store::redis` for
/// `store::redis::pipe`, from `src/store/redis/pipe.rs`; the crate for
/// `store`, from `src/store/mod.rs`).
fn parent(module: &str) -> Vec<String> {
    let mut parts: Vec<String> = module.split("::").map(str::to_string).collect();
    parts.pop();
    parts
}

fn longest_known(parts: &[String], known: &BTreeMap<String, PathBuf>) -> Option<String> {
    (1..=parts.len())
        .rev()
        .map(|n| parts[..n].join("::"))
        .find(|m| known.contains_key(m))
}

/// The room of a module: the rank of the longest room name it is, or is
/// inside of.
fn room(module: &str) -> Option<usize> {
    ROOMS
        .iter()
        .enumerate()
        .flat_map(|(rank, room)| room.iter().map(move |name| (rank, *name)))
        .filter(|(_, name)| module == *name || module.starts_with(&format!("{name}::")))
        .max_by_key(|(_, name)| name.len())
        .map(|(rank, _)| rank)
}

fn allowed(from: &str, to: &str) -> bool {
    ALLOWED
        .iter()
        .any(|(f, t, _)| from == *f && (to == *t || to.starts_with(&format!("{t}::"))))
}

#[test]
fn every_import_points_down_the_written_order() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let known = modules(&src);
    let mut wrong = Vec::new();
    for (module, path) in &known {
        let Some(from) = room(module) else {
            wrong.push(format!(
                "{}: module {module} is in no room of ROOMS",
                path.display()
            ));
            continue;
        };
        for u in uses(module, path, &known) {
            let Some(to) = room(&u.to) else {
                continue;
            };
            if to < from && !allowed(module, &u.to) {
                wrong.push(format!(
                    "{}:{}: {module} uses {}, a room above it (docs/architecture.md)",
                    path.display(),
                    u.line,
                    u.to
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn modules_import_each_other_in_one_direction() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let known = modules(&src);
    // edges between modules, each with where it is written
    let mut edges: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (module, path) in &known {
        for u in uses(module, path, &known) {
            // a module's own submodules and parents are one room's inside
            if u.to.starts_with(&format!("{module}::"))
                || module.starts_with(&format!("{}::", u.to))
            {
                continue;
            }
            if allowed(module, &u.to) {
                continue;
            }
            edges
                .entry(module.clone())
                .or_default()
                .entry(u.to.clone())
                .or_insert_with(|| format!("{}:{}", path.display(), u.line));
        }
    }
    let cycles = strongly_connected(&edges);
    let described: Vec<String> = cycles
        .iter()
        .map(|c| {
            let set: BTreeSet<&String> = c.iter().collect();
            let lines: Vec<String> = c
                .iter()
                .flat_map(|a| {
                    edges[a]
                        .iter()
                        .filter(|(b, _)| set.contains(b))
                        .map(move |(b, at)| format!("  {a} -> {b} ({at})"))
                })
                .collect();
            format!("{}:\n{}", c.join(", "), lines.join("\n"))
        })
        .collect();
    assert!(
        described.is_empty(),
        "import cycles:\n{}",
        described.join("\n")
    );
}

/// The strongly connected components of more than one module (Tarjan).
fn strongly_connected(edges: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeMap<String, String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on.insert(v);
            if let Some(next) = self.edges.get(v) {
                for w in next.keys() {
                    let w = w.as_str();
                    if !self.index.contains_key(w) {
                        self.visit(w);
                        let low = self.low[v].min(self.low[w]);
                        self.low.insert(v, low);
                    } else if self.on.contains(w) {
                        let low = self.low[v].min(self.index[w]);
                        self.low.insert(v, low);
                    }
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.out.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.out
}

/// Each room in the order is written in `docs/architecture.md`, so the
/// document and this test say the same.
#[test]
fn the_written_order_names_every_room() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md"))
            .expect("docs/architecture.md");
    for module in ROOMS.iter().flat_map(|r| r.iter()) {
        assert!(
            doc.contains(&format!("`{module}`")),
            "docs/architecture.md does not name `{module}`"
        );
    }
}

/// The reader sees imports: `use super::…`, `use crate::…` and paths
/// inside code, and none in comments (else the checks above could pass on
/// nothing).
#[test]
fn the_reader_finds_the_imports_it_checks() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let known = modules(&src);
    let named = |module: &str| -> BTreeSet<String> {
        uses(module, &known[module], &known)
            .into_iter()
            .map(|u| u.to)
            .collect()
    };
    let pipe = named("store::redis::pipe");
    assert!(
        pipe.contains("store::redis::batch") && pipe.contains("store::redis::resp"),
        "{pipe:?}"
    );
    assert!(pipe.contains("background"), "a path inside code: {pipe:?}");
    // only a doc comment of `background` names `crate::serving`
    assert!(!named("background").contains("serving"));
    assert!(named("service").contains("limiter"));
    let edges: usize = known.keys().map(|m| named(m).len()).sum();
    assert!(edges > 150, "{edges} imports read");
}
