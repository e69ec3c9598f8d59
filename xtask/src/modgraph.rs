//! A crate's module graph: which source file uses which (`crate::`, `super::`, `self::` paths
//! and paths through a child module), the import cycles in it, and the same graph by folder
//! (each file collapsed to its top-level folder under the crate's root). Its tests keep the
//! hypervisor's flow one way (run loop → exit handling → VM model), as docs/PROFILER.md and the
//! README's layout describe, and the analyzer's folders one way (views and live → model →
//! naming), as docs/ANALYZER.md describes.
//!
//! A text scan, not a parser: comments are skipped, `mod name;` declarations (with `#[path]`)
//! give the files, and a path resolves to the deepest module it names. Macros exported at the
//! crate root (`println!`) resolve to the file that defines them. Declaring a child module is
//! containment, not a use: only paths make edges. Test modules are scanned like the rest: a
//! test that uses another module is an edge too.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// One crate's modules: module path (`run.rs`) → its file, and the edges between files.
#[derive(Debug, Default)]
pub struct Graph {
    /// Module path ("" for the crate root) → file.
    pub modules: BTreeMap<String, PathBuf>,
    /// File → the files it uses (not itself).
    pub edges: BTreeMap<PathBuf, Vec<PathBuf>>,
}

/// The source text with `//` comments removed (string literals keep their `//`).
fn strip_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    for line in src.lines() {
        let mut in_str = false;
        let mut prev = ' ';
        let mut cut = line.len();
        for (i, c) in line.char_indices() {
            if c == '"' && prev != '\\' {
                in_str = !in_str;
            }
            if !in_str && c == '/' && prev == '/' {
                cut = i - 1;
                break;
            }
            prev = c;
        }
        out.push_str(&line[..cut]);
        out.push('\n');
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The `mod name;` declarations of a file: (name, `#[path]` if any).
fn child_decls(src: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut path_attr: Option<String> = None;
    for line in src.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("#[path = \"") {
            path_attr = rest.split('"').next().map(String::from);
            continue;
        }
        let decl = line
            .strip_prefix("pub(crate) mod ")
            .or_else(|| line.strip_prefix("pub mod "))
            .or_else(|| line.strip_prefix("mod "));
        if let Some(name) = decl.and_then(|d| d.strip_suffix(';')) {
            out.push((name.trim().to_string(), path_attr.take()));
        } else if !line.starts_with("#[") {
            path_attr = None;
        }
    }
    out
}

/// The directory a file's child modules live in.
fn child_dir(file: &Path) -> PathBuf {
    let parent = file.parent().unwrap_or(Path::new(""));
    match file.file_name().and_then(|n| n.to_str()) {
        Some("mod.rs" | "main.rs" | "lib.rs") => parent.to_path_buf(),
        _ => parent.join(file.file_stem().unwrap_or_default()),
    }
}

/// Every path a file names after `crate::`, `super::`, `self::` or one of `children::`, as
/// (start, segments): start is "crate", "super" (repeated as needed) or "self".
fn paths(src: &str, children: &[String]) -> Vec<(Vec<String>, Vec<String>)> {
    let chars: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if !is_ident(chars[i]) || (i > 0 && (is_ident(chars[i - 1]) || chars[i - 1] == '$')) {
            i += 1;
            continue;
        }
        // A word not preceded by `::` (a path's start) followed by `::`.
        let start = i;
        while i < chars.len() && is_ident(chars[i]) {
            i += 1;
        }
        let word: String = chars[start..i].iter().collect();
        let after_colons = start >= 2 && chars[start - 2] == ':' && chars[start - 1] == ':';
        let head = ["crate", "super", "self"].contains(&word.as_str()) || children.contains(&word);
        if after_colons || !head {
            continue;
        }
        let mut prefix = vec![word];
        let mut j = i;
        let mut segs: Vec<String> = Vec::new();
        // `super::super::`...
        loop {
            if chars.get(j) == Some(&':') && chars.get(j + 1) == Some(&':') {
                j += 2;
            } else {
                break;
            }
            let s = j;
            while j < chars.len() && is_ident(chars[j]) {
                j += 1;
            }
            let seg: String = chars[s..j].iter().collect();
            if seg.is_empty() {
                // `{ a, b::c }`: each item is a path of its own under the prefix.
                if chars.get(j) == Some(&'{') {
                    let mut depth = 0;
                    let mut k = j;
                    let mut item = String::new();
                    let mut items = Vec::new();
                    while k < chars.len() {
                        let c = chars[k];
                        match c {
                            '{' => {
                                depth += 1;
                                if depth > 1 {
                                    item.push(c);
                                }
                            }
                            '}' => {
                                depth -= 1;
                                if depth == 0 {
                                    items.push(std::mem::take(&mut item));
                                    break;
                                }
                                item.push(c);
                            }
                            ',' if depth == 1 => items.push(std::mem::take(&mut item)),
                            _ => item.push(c),
                        }
                        k += 1;
                    }
                    for it in items {
                        let it: String = it.chars().filter(|c| !c.is_whitespace()).collect();
                        let first: Vec<String> = it
                            .split("::")
                            .take_while(|s| s.chars().all(is_ident) && !s.is_empty())
                            .map(String::from)
                            .collect();
                        let mut full = segs.clone();
                        full.extend(first);
                        out.push((prefix.clone(), full));
                    }
                    j = k;
                }
                break;
            }
            if seg == "super" && segs.is_empty() && prefix.iter().all(|p| p == "super") {
                prefix.push(seg);
            } else {
                segs.push(seg);
            }
        }
        if !segs.is_empty() || prefix.len() > 1 || prefix[0] == "super" {
            out.push((prefix, segs));
        }
        i = j.max(i);
    }
    out
}

/// The module graph of the crate whose root file is `root`.
pub fn crate_graph(root: &Path) -> std::io::Result<Graph> {
    let mut g = Graph::default();
    let mut sources: BTreeMap<String, (PathBuf, String, Vec<String>)> = BTreeMap::new();
    let mut todo = vec![(String::new(), root.to_path_buf())];
    let mut macros: BTreeMap<String, String> = BTreeMap::new();
    while let Some((module, file)) = todo.pop() {
        let src = strip_comments(&fs::read_to_string(&file)?);
        let mut children = Vec::new();
        for (name, path) in child_decls(&src) {
            let dir = child_dir(&file);
            let child = match path {
                Some(p) => file.parent().unwrap_or(Path::new("")).join(p),
                None if dir.join(format!("{name}.rs")).exists() => dir.join(format!("{name}.rs")),
                None => dir.join(&name).join("mod.rs"),
            };
            let child_module = if module.is_empty() {
                name.clone()
            } else {
                format!("{module}::{name}")
            };
            todo.push((child_module, child));
            children.push(name);
        }
        for line in src.lines() {
            if let Some(rest) = line.trim().strip_prefix("macro_rules! ") {
                let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
                macros.insert(name, module.clone());
            }
        }
        g.modules.insert(module.clone(), file.clone());
        sources.insert(module, (file, src, children));
    }
    for (module, (file, src, children)) in &sources {
        let mut targets = Vec::new();
        for (prefix, segs) in paths(src, children) {
            let mut at: Vec<&str> = if module.is_empty() {
                Vec::new()
            } else {
                module.split("::").collect()
            };
            let mut segs: &[String] = &segs;
            match prefix[0].as_str() {
                "crate" => at.clear(),
                "super" => {
                    for _ in &prefix {
                        at.pop();
                    }
                }
                "self" => {}
                child => at.push(child),
            }
            let mut resolved = at.join("::");
            // Descend while the next segment is a module.
            while let Some((first, rest)) = segs.split_first() {
                let deeper = if resolved.is_empty() {
                    first.clone()
                } else {
                    format!("{resolved}::{first}")
                };
                if g.modules.contains_key(&deeper) {
                    resolved = deeper;
                    segs = rest;
                } else {
                    if resolved.is_empty()
                        && let Some(m) = macros.get(first)
                    {
                        resolved = m.clone();
                    }
                    break;
                }
            }
            if let Some(target) = g.modules.get(&resolved)
                && target != file
                && !targets.contains(target)
            {
                targets.push(target.clone());
            }
        }
        g.edges.insert(file.clone(), targets);
    }
    Ok(g)
}

/// The import cycles: every strongly connected set of more than one file (Tarjan's algorithm),
/// each sorted.
pub fn cycles(g: &Graph) -> Vec<Vec<PathBuf>> {
    strongly_connected(&g.edges)
}

/// Every strongly connected set of more than one node of `edges` (Tarjan's algorithm), each
/// sorted.
fn strongly_connected<N: Ord + Clone>(edges: &BTreeMap<N, Vec<N>>) -> Vec<Vec<N>> {
    struct Tarjan<'a, N> {
        edges: &'a BTreeMap<N, Vec<N>>,
        index: BTreeMap<&'a N, usize>,
        low: BTreeMap<&'a N, usize>,
        stack: Vec<&'a N>,
        on_stack: Vec<&'a N>,
        out: Vec<Vec<N>>,
    }
    impl<'a, N: Ord + Clone> Tarjan<'a, N> {
        fn visit(&mut self, v: &'a N) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.push(v);
            for w in self.edges.get(v).into_iter().flatten() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low[v];
                    self.low.insert(v, lv.min(lw));
                } else if self.on_stack.contains(&w) {
                    let iw = self.index[w];
                    let lv = self.low[v];
                    self.low.insert(v, lv.min(iw));
                }
            }
            if self.low[v] == self.index[v] {
                let mut scc = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.retain(|x| *x != w);
                    scc.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    self.out.push(scc);
                }
            }
        }
    }
    let mut t = Tarjan {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: Vec::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !t.index.contains_key(v) {
            t.visit(v);
        }
    }
    t.out
}

/// A crate's graph by folder: each file is its top-level folder under the crate's root
/// directory (`model` for `model/replay.rs` and `model/mod.rs`), a file directly in the root
/// directory is itself (`lib.rs`, `main.rs`). Each edge between two folders keeps the file
/// edges that make it, to name them.
#[derive(Debug, Default)]
pub struct FolderGraph {
    /// Folder → the folders it uses (not itself) → the file edges (from, to) behind that.
    pub edges: BTreeMap<String, BTreeMap<String, Vec<(PathBuf, PathBuf)>>>,
}

/// The folder of `file` under `root_dir`: its first component (a file directly in `root_dir`
/// is its own folder).
fn folder_of(file: &Path, root_dir: &Path) -> String {
    file.strip_prefix(root_dir)
        .unwrap_or(file)
        .components()
        .next()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// `g` collapsed to the top-level folders under `root_dir` (the directory of the crate's root
/// file): any crate, the hypervisor's too.
pub fn folder_graph(g: &Graph, root_dir: &Path) -> FolderGraph {
    let mut fg = FolderGraph::default();
    for (from, targets) in &g.edges {
        let a = folder_of(from, root_dir);
        let uses = fg.edges.entry(a.clone()).or_default();
        for to in targets {
            let b = folder_of(to, root_dir);
            if b != a {
                uses.entry(b).or_default().push((from.clone(), to.clone()));
            }
        }
    }
    fg
}

/// The cycles between folders: every strongly connected set of more than one folder, each
/// sorted. A folder cycle need not be a file cycle (`a/x.rs` uses `b/y.rs`, `b/z.rs` uses
/// `a/w.rs`).
pub fn folder_cycles(fg: &FolderGraph) -> Vec<Vec<String>> {
    let edges: BTreeMap<String, Vec<String>> = fg
        .edges
        .iter()
        .map(|(a, uses)| (a.clone(), uses.keys().cloned().collect()))
        .collect();
    strongly_connected(&edges)
}

/// Each use between folders that `allowed` (folder → folder) does not list, as
/// "from -> to (a -> b)", the two files first; `top` are the folders that may use any other
/// (the crate's root files). A use of a `top` folder from another is never allowed.
pub fn folder_rule_breaks(
    fg: &FolderGraph,
    root_dir: &Path,
    allowed: &[(&str, &str)],
    top: &[&str],
) -> Vec<String> {
    let mut out = Vec::new();
    for (a, uses) in &fg.edges {
        if top.contains(&a.as_str()) {
            continue;
        }
        for (b, files) in uses {
            if allowed.contains(&(a.as_str(), b.as_str())) {
                continue;
            }
            for (from, to) in files {
                let rel = |p: &Path| p.strip_prefix(root_dir).unwrap_or(p).display().to_string();
                out.push(format!("{} -> {} ({a} -> {b})", rel(from), rel(to)));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, files: &[(&str, &str)]) {
        for (name, text) in files {
            let p = dir.join(name);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        }
    }

    fn rel(dir: &Path, scc: &[PathBuf]) -> Vec<String> {
        scc.iter()
            .map(|p| p.strip_prefix(dir).unwrap().display().to_string())
            .collect()
    }

    #[test]
    fn finds_a_cycle_through_super_and_a_child_and_none_once_it_is_broken() {
        let dir = std::env::temp_dir().join(format!("modgraph-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        write(
            &dir,
            &[
                (
                    "main.rs",
                    "mod exit;\nmod vm;\n#[macro_export]\nmacro_rules! say { () => {} }\n",
                ),
                (
                    "vm.rs",
                    "use crate::exit::Flow; // crate::nothing\nfn f() { crate::say!(); }\n",
                ),
                (
                    "exit/mod.rs",
                    "mod io;\npub enum Flow {}\nfn g() { io::handle() }\n",
                ),
                (
                    "exit/io.rs",
                    "use super::{Flow, helper};\nuse crate::vm::Vm;\n",
                ),
            ],
        );
        let g = crate_graph(&dir.join("main.rs")).unwrap();
        assert_eq!(
            g.edges[&dir.join("vm.rs")],
            vec![dir.join("exit/mod.rs"), dir.join("main.rs")],
            "a use and a macro exported at the root; the comment is no use"
        );
        let found: Vec<_> = cycles(&g).iter().map(|c| rel(&dir, c)).collect();
        assert_eq!(found, vec![vec!["exit/io.rs", "exit/mod.rs", "vm.rs"]]);

        // The helper moves out of the parent and the handler no longer names the VM model's user.
        write(
            &dir,
            &[
                ("exit/io.rs", "use crate::helpers::helper;\n"),
                ("vm.rs", "use crate::exit::Flow;\n"),
                ("main.rs", "mod exit;\nmod vm;\nmod helpers;\n"),
                ("helpers.rs", "pub fn helper() {}\n"),
            ],
        );
        let g = crate_graph(&dir.join("main.rs")).unwrap();
        assert!(cycles(&g).is_empty(), "{:?}", cycles(&g));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn finds_a_folder_cycle_that_is_no_file_cycle_and_names_the_files_that_break_the_rule() {
        let dir = std::env::temp_dir().join(format!("modgraph-folders-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        write(
            &dir,
            &[
                ("lib.rs", "pub mod a;\npub mod b;\npub use a::x::X;\n"),
                ("a/mod.rs", "pub mod w;\npub mod x;\n"),
                ("a/x.rs", "use crate::b::y::Y;\npub struct X;\n"),
                ("a/w.rs", "pub struct W;\n"),
                ("b/mod.rs", "pub mod y;\npub mod z;\n"),
                ("b/y.rs", "pub struct Y;\n"),
                ("b/z.rs", "use crate::a::w::W;\n"),
            ],
        );
        let g = crate_graph(&dir.join("lib.rs")).unwrap();
        assert!(cycles(&g).is_empty(), "{:?}", cycles(&g));
        let fg = folder_graph(&g, &dir);
        assert_eq!(folder_cycles(&fg), vec![vec!["a", "b"]]);
        // a may use b, not the other way; the root file may use anything.
        assert_eq!(
            folder_rule_breaks(&fg, &dir, &[("a", "b")], &["lib.rs"]),
            vec!["b/z.rs -> a/w.rs (b -> a)"]
        );

        // W moves to b: one way, no folder cycle.
        write(
            &dir,
            &[
                ("a/mod.rs", "pub mod x;\n"),
                ("b/mod.rs", "pub mod w;\npub mod y;\npub mod z;\n"),
                ("b/w.rs", "pub struct W;\n"),
                ("b/z.rs", "use crate::b::w::W;\n"),
            ],
        );
        let g = crate_graph(&dir.join("lib.rs")).unwrap();
        let fg = folder_graph(&g, &dir);
        assert!(folder_cycles(&fg).is_empty(), "{:?}", folder_cycles(&fg));
        assert!(folder_rule_breaks(&fg, &dir, &[("a", "b")], &["lib.rs"]).is_empty());
        let _ = fs::remove_dir_all(&dir);
    }

    /// The hypervisor's binary and library have no import cycle between their modules.
    #[test]
    fn hypervisor_modules_have_no_import_cycle() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hypervisor/src");
        for root in [src.join("bin/hvprof/main.rs"), src.join("lib.rs")] {
            let g = crate_graph(&root).unwrap();
            assert!(
                g.modules.len() > 5,
                "{} modules under {root:?}",
                g.modules.len()
            );
            let found = cycles(&g);
            assert!(
                found.is_empty(),
                "import cycles among the modules of {root:?}:\n{}",
                found
                    .iter()
                    .map(|c| rel(&src, c).join(" <-> "))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }

    /// The hypervisor's folders (the binary's `vm/`, `vmexit/`, `vcpu/`, `profiler/`, `arch/`;
    /// the library's `devices/`, `profiler/`; each file at the top as its own folder) have no
    /// cycle: the run loop (`run.rs`) calls the exit handlers, which use the VM model, its
    /// devices and the profiler, never back.
    #[test]
    fn hypervisor_folders_have_no_cycle() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hypervisor/src");
        for (dir, root) in [(src.join("bin/hvprof"), "main.rs"), (src.clone(), "lib.rs")] {
            folders_have_no_cycle(&dir, root);
        }
    }

    fn folders_have_no_cycle(dir: &Path, root: &str) {
        let g = crate_graph(&dir.join(root)).unwrap();
        let fg = folder_graph(&g, dir);
        let found = folder_cycles(&fg);
        let why = |a: &str, b: &str| -> String {
            fg.edges
                .get(a)
                .and_then(|m| m.get(b))
                .map(|v| {
                    v.iter()
                        .map(|(f, t)| {
                            format!(
                                "{} -> {}",
                                rel(dir, std::slice::from_ref(f))[0],
                                rel(dir, std::slice::from_ref(t))[0]
                            )
                        })
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default()
        };
        assert!(
            found.is_empty(),
            "cycles among the folders of {dir:?}:\n{}",
            found
                .iter()
                .map(|c| {
                    let mut lines = vec![c.join(" <-> ")];
                    for a in c {
                        for b in c {
                            if a != b && !why(a, b).is_empty() {
                                lines.push(format!("  {a} -> {b}: {}", why(a, b)));
                            }
                        }
                    }
                    lines.join("\n")
                })
                .collect::<Vec<_>>()
                .join("\n")
        );
    }

    /// The analyzer's source directory.
    fn analyzer_src() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/hvprof-analyze/src")
    }

    /// The analyzer's one-way rule (docs/ANALYZER.md): the folders each may use. `naming` uses
    /// none; `main.rs` and `lib.rs` at the top use any, and none uses them.
    const ANALYZER_ALLOWED: [(&str, &str); 5] = [
        ("views", "model"),
        ("views", "naming"),
        ("live", "model"),
        ("live", "naming"),
        ("model", "naming"),
    ];
    const ANALYZER_TOP: [&str; 2] = ["lib.rs", "main.rs"];

    /// The analyzer's library and binary have no import cycle between their files.
    #[test]
    fn analyzer_modules_have_no_import_cycle() {
        let src = analyzer_src();
        for root in [src.join("lib.rs"), src.join("main.rs")] {
            let g = crate_graph(&root).unwrap();
            let found = cycles(&g);
            assert!(
                found.is_empty(),
                "import cycles among the modules of {root:?}:\n{}",
                found
                    .iter()
                    .map(|c| rel(&src, c).join(" <-> "))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
        let g = crate_graph(&src.join("lib.rs")).unwrap();
        assert!(g.modules.len() > 20, "{} modules", g.modules.len());
    }

    /// The analyzer's folders have no cycle between them.
    #[test]
    fn analyzer_folders_have_no_cycle() {
        let src = analyzer_src();
        let fg = folder_graph(&crate_graph(&src.join("lib.rs")).unwrap(), &src);
        for folder in ["model", "naming", "views", "live"] {
            assert!(fg.edges.contains_key(folder), "no folder {folder}");
        }
        let found = folder_cycles(&fg);
        assert!(
            found.is_empty(),
            "cycles between the analyzer's folders:\n{}",
            found
                .iter()
                .map(|c| c.join(" <-> "))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }

    /// The analyzer's folders use one another one way only: views and live use model and
    /// naming, model uses naming, naming uses none of them.
    #[test]
    fn analyzer_folders_keep_the_one_way_rule() {
        let src = analyzer_src();
        let fg = folder_graph(&crate_graph(&src.join("lib.rs")).unwrap(), &src);
        let breaks = folder_rule_breaks(&fg, &src, &ANALYZER_ALLOWED, &ANALYZER_TOP);
        assert!(
            breaks.is_empty(),
            "uses against the analyzer's one-way rule (allowed: {ANALYZER_ALLOWED:?}):\n{}",
            breaks.join("\n")
        );
    }
}
