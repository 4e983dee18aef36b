//! No two files of a crate import each other, directly or around a circle: the library
//! (`src/`) and the load bench (`benches/load/`). A file may use what a module above it in its
//! own folder chain defines (a `mod.rs` is its folder's shared vocabulary), so those edges
//! are left out; any other circle fails, naming its files and what each takes from the next.
//!
//! Imports are read as text: every `crate::` and `super::` path outside comments and the
//! test module at the end of a file, resolved to the file that defines its longest prefix.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A crate's files by module path (`[]` is the root).
struct Crate {
    files: BTreeMap<Vec<String>, PathBuf>,
}

impl Crate {
    fn read(dir: &Path, root: &str) -> Crate {
        let mut files = BTreeMap::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(folder) = stack.pop() {
            for entry in std::fs::read_dir(&folder).expect("read a source folder") {
                let path = entry.expect("a folder entry").path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                if path.extension().is_none_or(|e| e != "rs") {
                    continue;
                }
                let relative = path.strip_prefix(dir).expect("below the crate folder");
                let mut module: Vec<String> = relative
                    .iter()
                    .map(|part| part.to_string_lossy().trim_end_matches(".rs").to_string())
                    .collect();
                if module.last().is_some_and(|m| m == "mod" || m == root) {
                    module.pop();
                }
                files.insert(module, path);
            }
        }
        Crate { files }
    }

    /// The file defining the longest prefix of `path`.
    fn file_of(&self, path: &[String]) -> Option<&Vec<String>> {
        (0..=path.len())
            .rev()
            .find_map(|n| self.files.get_key_value(&path[..n]).map(|(k, _)| k))
    }
}

/// The code of a file without comments and without its inline `#[cfg(test)]` modules (whose
/// `super` is the file itself, and which may use anything).
fn code(text: &str) -> String {
    let text: String = text
        .lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let mut kept = String::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("#[cfg(test)]") {
        kept.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let inline_module = after.trim_start().starts_with("mod ")
            && after
                .find('{')
                .is_some_and(|b| after.find(';').is_none_or(|s| b < s));
        if !inline_module {
            rest = after;
            continue;
        }
        let open = after.find('{').unwrap_or_default();
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    kept.push_str(rest);
    kept
}

/// Every path the code names from `crate::` or `super::`, made absolute for `module`.
fn paths(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    for (anchor, base) in [
        ("crate::", Vec::new()),
        ("super::", module[..module.len().saturating_sub(1)].to_vec()),
    ] {
        let mut rest = code;
        while let Some(at) = rest.find(anchor) {
            let before = rest[..at].chars().last();
            rest = &rest[at + anchor.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            for tail in expand(rest) {
                let mut path = base.clone();
                path.extend(tail);
                found.push(path);
            }
        }
    }
    found
}

/// The segments after an anchor: `a::b::C` is one path, `{a::B, c}` (one level) several.
fn expand(rest: &str) -> Vec<Vec<String>> {
    let segments = |s: &str| -> Vec<String> {
        s.split("::")
            .map(|seg| {
                seg.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect::<String>()
            })
            .take_while(|seg| !seg.is_empty())
            .collect()
    };
    if let Some(group) = rest.strip_prefix('{') {
        let end = group.find('}').unwrap_or(group.len());
        return group[..end]
            .split(',')
            .map(|item| segments(item.trim()))
            .filter(|p| !p.is_empty())
            .collect();
    }
    let head: String = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':' || *c == '{')
        .collect();
    let head = head.trim_end_matches("::{").trim_end_matches(':');
    vec![segments(head)]
}

/// Which file imports which, each edge with the names it takes.
type Edges = BTreeMap<Vec<String>, BTreeMap<Vec<String>, BTreeSet<String>>>;

/// The import graph of a crate's files.
fn import_graph(krate: &Crate) -> Edges {
    let mut edges: Edges = BTreeMap::new();
    for (module, path) in &krate.files {
        let text = std::fs::read_to_string(path).expect("read a source file");
        for named in paths(&code(&text), module) {
            let Some(target) = krate.file_of(&named) else {
                continue;
            };
            // A module above it in its own folder chain: its vocabulary, not a dependency.
            if target == module || module.starts_with(target) {
                continue;
            }
            let name = named[target.len()..]
                .first()
                .or(target.last())
                .cloned()
                .unwrap_or_default();
            edges
                .entry(module.clone())
                .or_default()
                .entry(target.clone())
                .or_default()
                .insert(name);
        }
    }
    edges
}

/// Circles among the files of the crate in `dir`, each as its files and edges.
fn circles(dir: &Path, root: &str) -> Vec<String> {
    let krate = Crate::read(dir, root);
    let edges = import_graph(&krate);
    strongly_connected(&krate, &edges)
        .into_iter()
        .filter(|component| component.len() > 1)
        .map(|component| {
            let mut lines = Vec::new();
            for from in &component {
                for (to, names) in edges.get(from).into_iter().flatten() {
                    if component.contains(to) {
                        lines.push(format!(
                            "  {} -> {}: {}",
                            krate.files[from].display(),
                            krate.files[to].display(),
                            names.iter().cloned().collect::<Vec<_>>().join(", ")
                        ));
                    }
                }
            }
            lines.join("\n")
        })
        .collect()
}

/// Tarjan's algorithm over the module graph.
fn strongly_connected(krate: &Crate, edges: &Edges) -> Vec<BTreeSet<Vec<String>>> {
    struct Walk<'a> {
        edges: &'a Edges,
        index: BTreeMap<Vec<String>, usize>,
        low: BTreeMap<Vec<String>, usize>,
        stack: Vec<Vec<String>>,
        on_stack: BTreeSet<Vec<String>>,
        found: Vec<BTreeSet<Vec<String>>>,
    }
    fn visit(walk: &mut Walk<'_>, node: &Vec<String>) {
        let n = walk.index.len();
        walk.index.insert(node.clone(), n);
        walk.low.insert(node.clone(), n);
        walk.stack.push(node.clone());
        walk.on_stack.insert(node.clone());
        let next: Vec<Vec<String>> = walk
            .edges
            .get(node)
            .map(|targets| targets.keys().cloned().collect())
            .unwrap_or_default();
        for to in next {
            if !walk.index.contains_key(&to) {
                visit(walk, &to);
                let low = walk.low[node].min(walk.low[&to]);
                walk.low.insert(node.clone(), low);
            } else if walk.on_stack.contains(&to) {
                let low = walk.low[node].min(walk.index[&to]);
                walk.low.insert(node.clone(), low);
            }
        }
        if walk.low[node] == walk.index[node] {
            let mut component = BTreeSet::new();
            while let Some(top) = walk.stack.pop() {
                walk.on_stack.remove(&top);
                let done = &top == node;
                component.insert(top);
                if done {
                    break;
                }
            }
            walk.found.push(component);
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for node in krate.files.keys() {
        if !walk.index.contains_key(node) {
            visit(&mut walk, node);
        }
    }
    walk.found
}

#[test]
fn no_two_files_import_each_other() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for (dir, root) in [("src", "lib"), ("benches/load", "main")] {
        for circle in circles(&repo.join(dir), root) {
            found.push(format!("a circle in {dir}/:\n{circle}"));
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// What files under `folder` import from outside it that is not a leaf (a file importing
/// nothing of the crate), as `importer -> imported (what it imports)`.
fn non_leaf_imports(krate: &Crate, edges: &Edges, folder: &str) -> Vec<String> {
    let inside = |module: &Vec<String>| module.first().is_some_and(|m| m == folder);
    let mut found = Vec::new();
    for (from, targets) in edges.iter().filter(|(from, _)| inside(from)) {
        for (to, names) in targets {
            if inside(to) || edges.get(to).is_none_or(|own| own.is_empty()) {
                continue;
            }
            found.push(format!(
                "{} -> {} ({}), which imports {}",
                krate.files[from].display(),
                krate.files[to].display(),
                names.iter().cloned().collect::<Vec<_>>().join(", "),
                edges[to]
                    .keys()
                    .map(|m| krate.files[m].display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    }
    found
}

/// The config is the bottom of the house: every module may read it, so it may import only
/// leaves (pure rules and constants that import nothing of callbackd). Anything more and a
/// module it reaches could not read the config without a circle.
#[test]
fn the_config_imports_only_leaves() {
    let krate = Crate::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), "lib");
    let found = non_leaf_imports(&krate, &import_graph(&krate), "config");
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn a_non_leaf_import_of_the_config_is_found() {
    let dir = tempfile::tempdir().expect("temp dir");
    let files = [
        ("lib.rs", "pub mod config;\npub mod leaf;\npub mod store;\n"),
        (
            "config.rs",
            "use crate::leaf::RULE;\nuse crate::store::Thing;\n",
        ),
        ("leaf.rs", "pub const RULE: u8 = 1;\n"),
        ("store.rs", "use crate::leaf::RULE;\npub struct Thing;\n"),
    ];
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).expect("write a source file");
    }
    let krate = Crate::read(dir.path(), "lib");
    let found = non_leaf_imports(&krate, &import_graph(&krate), "config");
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("store.rs (Thing)"), "{found:?}");
}

#[test]
fn a_circle_is_found() {
    let dir = tempfile::tempdir().expect("temp dir");
    let files = [
        ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
        ("a.rs", "use crate::b::Thing;\n"),
        (
            "b.rs",
            "pub struct Thing;\nuse crate::c::{Other, more::Deep};\n",
        ),
        (
            "c.rs",
            "// use crate::b::not_real;\n#[cfg(test)]\nmod t;\npub struct Other;\n\
             fn f() { crate::a::g() }\n#[cfg(test)]\nmod tests {\n    use crate::b::x;\n}\n",
        ),
    ];
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).expect("write a source file");
    }
    let found = circles(dir.path(), "lib");
    assert_eq!(found.len(), 1, "{found:?}");
    for file in ["a.rs", "b.rs", "c.rs"] {
        assert!(found[0].contains(file), "{found:?}");
    }
    // A test module may import anything: only c -> a remains, no circle.
    std::fs::write(
        dir.path().join("c.rs"),
        "pub struct Other;\n#[cfg(test)]\nmod tests {\n    fn t() { crate::a::g() }\n}\n",
    )
    .expect("write");
    assert!(circles(dir.path(), "lib").is_empty());
}
