//! `cargo xtask profile --deb PACKAGE`: a Debian package for the guest, with what its
//! dependencies bring, and its debug files where the package archive has them.
//!
//! The dependencies are followed through `Depends` and `Pre-Depends` as apt's lists give them
//! (`apt-cache show`), the first alternative apt knows taken; packages that every Debian system
//! has (`Essential: yes`, such as dpkg and tar) are not followed unless asked for by name: a
//! program does not run them. Each package is downloaded once (`apt-get download`, kept in
//! `target/profile-cache/debs`) and unpacked once into `target/profile-cache/unpacked/`, without
//! its documentation, manual pages and translations. What goes into the guest leaves out any
//! file the guest image already holds byte for byte (libc, for one).
//!
//! Debug files are looked for as `PACKAGE-dbgsym` (Debian's automatic debug packages, which
//! live in the debian-debug archive) and kept beside the unpacked package: they go into the
//! analyzer's guest root at `/usr/lib/debug/.build-id/`, never into the guest.

use anyhow::{Context, Result, bail};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::linux::{cached_deb, extract, output};

/// Where apt is needed, what to do.
const APT_HINT: &str = "--deb takes packages from apt's lists: it needs apt-get and \
     apt-cache (Debian's apt package), the package mirrors (network) and current lists (run \
     `apt-get update` as root). A .deb file given by path needs only dpkg-deb.";

/// Folders of a package left out of the guest: documentation, manual pages, translations.
const LEFT_OUT: [&str; 7] = [
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/bug",
    "usr/share/doc-base",
];

/// One package made ready for the guest.
#[derive(Debug, Clone)]
pub struct Unpacked {
    pub name: String,
    pub version: String,
    /// Its files for the guest (the guest root's layout).
    pub tree: PathBuf,
    /// Its debug files (`usr/lib/debug/.build-id/...`), for the analyzer only.
    pub debug: Option<PathBuf>,
}

/// What `--deb` prepared.
#[derive(Debug, Default)]
pub struct Prepared {
    /// The packages asked for, then their dependencies, each once.
    pub packages: Vec<Unpacked>,
    /// Dependencies not followed: essential to Debian (dpkg, tar, ...).
    pub essential: Vec<String>,
    /// Dependencies apt knows no package for (virtual names without a provider in the lists).
    pub unresolved: Vec<String>,
}

impl Prepared {
    /// The packages without debug files.
    pub fn without_debug(&self) -> Vec<&str> {
        self.packages
            .iter()
            .filter(|p| p.debug.is_none())
            .map(|p| p.name.as_str())
            .collect()
    }
}

/// A package's control fields (`Package`, `Version`, `Depends`, ...).
type Stanza = HashMap<String, String>;

/// The stanzas of `apt-cache show` or `dpkg-deb -f` text: `Field: value` lines, continuation
/// lines (starting with a space) joined to the field before, stanzas separated by blank lines.
fn parse_stanzas(text: &str) -> Vec<Stanza> {
    let mut out = Vec::new();
    let mut cur = Stanza::new();
    let mut last: Option<String> = None;
    for line in text.lines() {
        if line.trim().is_empty() {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            last = None;
        } else if line.starts_with([' ', '\t']) {
            if let Some(v) = last.as_ref().and_then(|k| cur.get_mut(k)) {
                v.push(' ');
                v.push_str(line.trim());
            }
        } else if let Some((k, v)) = line.split_once(':') {
            cur.insert(k.to_owned(), v.trim().to_owned());
            last = Some(k.to_owned());
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// A `Depends` value as groups of alternatives, each a package name without its version
/// relation or architecture qualifier: `a (>= 1) | b:any, c` → [[a, b], [c]].
fn parse_depends(value: &str) -> Vec<Vec<String>> {
    value
        .split(',')
        .map(|group| {
            group
                .split('|')
                .filter_map(|alt| {
                    let name = alt.trim().split([' ', '(', '[', '<']).next()?;
                    let name = name.split(':').next()?.trim();
                    (!name.is_empty()).then(|| name.to_owned())
                })
                .collect::<Vec<_>>()
        })
        .filter(|g| !g.is_empty())
        .collect()
}

fn dependencies(s: &Stanza) -> Vec<Vec<String>> {
    ["Pre-Depends", "Depends"]
        .iter()
        .filter_map(|f| s.get(*f))
        .flat_map(|v| parse_depends(v))
        .collect()
}

fn field<'a>(s: &'a Stanza, k: &str) -> &'a str {
    s.get(k).map(String::as_str).unwrap_or("")
}

/// apt's candidate stanzas, looked up once per name (None: apt knows no such package, or only
/// a virtual one).
struct Lists {
    known: HashMap<String, Option<Stanza>>,
}

impl Lists {
    fn lookup(&mut self, names: &[String]) -> Result<()> {
        let new: Vec<&String> = names
            .iter()
            .filter(|n| !self.known.contains_key(*n))
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        // Names apt does not know are left out of its output (and only warned about).
        let out = Command::new("apt-cache")
            .args(["show", "--no-all-versions"])
            .args(&new)
            .output();
        let out = match out {
            Ok(o) => o,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("apt-cache not found. {APT_HINT}")
            }
            Err(e) => return Err(e).context("cannot run apt-cache"),
        };
        for s in parse_stanzas(&String::from_utf8_lossy(&out.stdout)) {
            let name = field(&s, "Package").to_owned();
            self.known.insert(name, Some(s));
        }
        for n in new {
            self.known.entry(n.clone()).or_insert(None);
        }
        Ok(())
    }

    fn get(&mut self, name: &str) -> Result<Option<Stanza>> {
        self.lookup(&[name.to_owned()])?;
        Ok(self.known.get(name).cloned().flatten())
    }
}

/// A package to fetch: its stanza, and its .deb when given as a file.
struct Wanted {
    stanza: Stanza,
    file: Option<PathBuf>,
}

/// The packages `specs` name (apt package names or .deb files) and their dependencies, in that
/// order, with what was not followed.
fn closure(specs: &[String], lists: &mut Lists) -> Result<(Vec<Wanted>, Vec<String>, Vec<String>)> {
    let mut todo: Vec<Wanted> = Vec::new();
    for spec in specs {
        let path = Path::new(spec);
        if spec.ends_with(".deb") || spec.contains('/') {
            if !path.is_file() {
                bail!("--deb {spec}: no such file");
            }
            let text = output(
                Command::new("dpkg-deb").arg("-f").arg(path),
                "dpkg-deb comes with Debian's dpkg package.",
            )
            .with_context(|| format!("--deb {spec}: not a Debian package"))?;
            let stanza = parse_stanzas(&text)
                .into_iter()
                .next()
                .with_context(|| format!("--deb {spec}: no control fields"))?;
            todo.push(Wanted {
                stanza,
                file: Some(path.to_owned()),
            });
        } else {
            let stanza = lists.get(spec)?.with_context(|| {
                format!(
                    "--deb {spec}: apt knows no package {spec} (`apt-cache show {spec}` found none). {APT_HINT}"
                )
            })?;
            todo.push(Wanted { stanza, file: None });
        }
    }
    let mut chosen: BTreeMap<String, usize> = BTreeMap::new();
    let mut order: Vec<Wanted> = Vec::new();
    let mut essential = Vec::new();
    let mut unresolved = Vec::new();
    // Breadth first: the packages asked for come first, in their order.
    let mut queue: std::collections::VecDeque<Wanted> = todo.into();
    while let Some(w) = queue.pop_front() {
        let name = field(&w.stanza, "Package").to_owned();
        if chosen.contains_key(&name) {
            continue;
        }
        let deps = dependencies(&w.stanza);
        chosen.insert(name, order.len());
        order.push(w);
        for group in deps {
            let pending = |n: &String| {
                chosen.contains_key(n)
                    || queue.iter().any(|q| field(&q.stanza, "Package") == n)
                    || essential.contains(n)
            };
            if group.iter().any(pending) {
                continue;
            }
            lists.lookup(&group)?;
            let found = group
                .iter()
                .find_map(|n| lists.known.get(n).cloned().flatten());
            match found {
                Some(s) if field(&s, "Essential") == "yes" => {
                    essential.push(field(&s, "Package").to_owned())
                }
                Some(s) => queue.push_back(Wanted {
                    stanza: s,
                    file: None,
                }),
                None => unresolved.push(group.join(" | ")),
            }
        }
    }
    essential.sort();
    essential.dedup();
    Ok((order, essential, unresolved))
}

/// The .deb of `name` at `version`, from the cache or downloaded into it.
fn download(debs: &Path, name: &str, version: &str) -> Result<PathBuf> {
    if let Some(p) = cached_deb(debs, name, Some(version))? {
        return Ok(p);
    }
    let spec = format!("{name}={version}");
    println!("xtask: apt-get download {spec}");
    output(
        Command::new("apt-get")
            .args(["download", "-q", &spec])
            .current_dir(debs),
        APT_HINT,
    )?;
    cached_deb(debs, name, Some(version))?
        .with_context(|| format!("apt-get download {spec} succeeded but left no {name}_*.deb"))
}

/// Removes `rel` under `root` if there.
fn remove(root: &Path, rel: &str) -> Result<()> {
    let p = root.join(rel);
    if p.is_dir() {
        std::fs::remove_dir_all(&p).with_context(|| format!("cannot remove {}", p.display()))?;
    }
    Ok(())
}

/// Removes the files of `tree` that `image` holds at the same path with the same bytes, and
/// the folders that leaves empty.
fn drop_image_files(tree: &Path, image: &Path) -> Result<()> {
    fn walk(dir: &Path, tree: &Path, image: &Path) -> Result<bool> {
        let mut empty = true;
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            let path = e.path();
            let meta = std::fs::symlink_metadata(&path)?;
            if meta.is_dir() {
                if walk(&path, tree, image)? {
                    std::fs::remove_dir(&path)?;
                } else {
                    empty = false;
                }
                continue;
            }
            let rel = path.strip_prefix(tree).unwrap_or(&path);
            let theirs = image.join(rel);
            let same = meta.is_file()
                && std::fs::symlink_metadata(&theirs)
                    .is_ok_and(|m| m.is_file() && m.len() == meta.len())
                && std::fs::read(&theirs)? == std::fs::read(&path)?;
            if same {
                std::fs::remove_file(&path)?;
            } else {
                empty = false;
            }
        }
        Ok(empty)
    }
    walk(tree, tree, image)?;
    Ok(())
}

/// Unpacks `deb` into `dir/root` (what the guest gets) once; `dir/complete` marks a finished
/// unpacking.
fn unpack(deb: &Path, dir: &Path, image_root: &Path) -> Result<PathBuf> {
    let root = dir.join("root");
    let done = dir.join("complete");
    if done.exists() {
        return Ok(root);
    }
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::create_dir_all(&root)?;
    let status = Command::new("dpkg-deb")
        .arg("-x")
        .arg(deb)
        .arg(&root)
        .status()
        .context("cannot run dpkg-deb (Debian's dpkg package)")?;
    if !status.success() {
        bail!("dpkg-deb -x {} failed", deb.display());
    }
    for rel in LEFT_OUT {
        remove(&root, rel)?;
    }
    drop_image_files(&root, image_root)?;
    std::fs::write(&done, b"")?;
    Ok(root)
}

/// The debug files of `name` at `version` from `name-dbgsym`, if apt's lists have it at that
/// version: unpacked once into `dir/debug`.
fn debug_files(
    lists: &mut Lists,
    debs: &Path,
    dir: &Path,
    name: &str,
    version: &str,
) -> Result<Option<PathBuf>> {
    let debug = dir.join("debug");
    let done = dir.join("debug-complete");
    if done.exists() {
        return Ok(debug.exists().then_some(debug));
    }
    let dbg = format!("{name}-dbgsym");
    let found = match lists.get(&dbg)? {
        Some(s) if field(&s, "Version") == version => {
            let deb = download(debs, &dbg, version)?;
            extract(&deb, &debug, &["./usr/lib/debug/.build-id/*"])?;
            Some(debug)
        }
        _ => None,
    };
    std::fs::write(&done, b"")?;
    Ok(found)
}

/// Downloads and unpacks the packages `specs` name and their dependencies (`cache`: the
/// download and unpacking cache; `image_root`: the guest image's own tree). Errors name the
/// package; nothing has booted yet.
pub fn prepare(specs: &[String], cache: &Path, image_root: &Path) -> Result<Prepared> {
    if specs.is_empty() {
        return Ok(Prepared::default());
    }
    let debs = cache.join("debs");
    std::fs::create_dir_all(&debs)?;
    // One preparation at a time over the shared cache: two runs at once (`cargo xtask test`
    // starts several) would download or unpack the same package into the same place.
    let lock = std::fs::File::create(cache.join("prepare.lock"))?;
    lock.lock()
        .with_context(|| format!("cannot lock {}", cache.join("prepare.lock").display()))?;
    let mut lists = Lists {
        known: HashMap::new(),
    };
    let (wanted, essential, unresolved) = closure(specs, &mut lists)?;
    let mut packages = Vec::new();
    for w in wanted {
        let name = field(&w.stanza, "Package").to_owned();
        let version = field(&w.stanza, "Version").to_owned();
        let deb = match &w.file {
            Some(f) => f.clone(),
            None => download(&debs, &name, &version)?,
        };
        // A file's version may be one apt has never seen: the unpacked copy is keyed by both.
        let key = format!("{name}_{}", version.replace(':', "%3a"));
        let dir = cache.join("unpacked").join(&key);
        let tree = unpack(&deb, &dir, image_root).with_context(|| format!("--deb: {name}"))?;
        let debug = debug_files(&mut lists, &debs, &dir, &name, &version)?;
        packages.push(Unpacked {
            name,
            version,
            tree,
            debug,
        });
    }
    Ok(Prepared {
        packages,
        essential,
        unresolved,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stanzas_and_their_continuation_lines() {
        let text = "Package: a\nVersion: 1:2.0-1\nDepends: b (>= 1),\n c | d\nDescription: x\n more\n\nPackage: b\nEssential: yes\n";
        let s = parse_stanzas(text);
        assert_eq!(s.len(), 2);
        assert_eq!(field(&s[0], "Version"), "1:2.0-1");
        assert_eq!(field(&s[0], "Depends"), "b (>= 1), c | d");
        assert_eq!(field(&s[1], "Essential"), "yes");
    }

    #[test]
    fn dependencies_lose_versions_and_qualifiers() {
        let d =
            parse_depends("libc6 (>= 2.34), libssl3 | libssl:any, python3:any (>= 3.9~) [amd64]");
        assert_eq!(
            d,
            vec![
                vec!["libc6".to_owned()],
                vec!["libssl3".to_owned(), "libssl".to_owned()],
                vec!["python3".to_owned()],
            ]
        );
        assert!(parse_depends("").is_empty());
        let s: Stanza = [
            ("Pre-Depends".to_owned(), "libc6 (>= 2.35)".to_owned()),
            ("Depends".to_owned(), "zlib1g".to_owned()),
        ]
        .into();
        assert_eq!(
            dependencies(&s),
            vec![vec!["libc6".to_owned()], vec!["zlib1g".to_owned()]]
        );
    }

    #[test]
    fn files_the_image_holds_are_left_out() {
        let base = std::env::temp_dir().join(format!("hvprof-debs-{}", std::process::id()));
        let (tree, image) = (base.join("tree"), base.join("image"));
        for d in [&tree, &image] {
            std::fs::create_dir_all(d.join("lib/x")).unwrap();
        }
        std::fs::write(tree.join("lib/x/libc.so.6"), b"same").unwrap();
        std::fs::write(image.join("lib/x/libc.so.6"), b"same").unwrap();
        std::fs::write(tree.join("lib/x/libz.so.1"), b"new").unwrap();
        std::fs::create_dir_all(tree.join("only/same")).unwrap();
        std::fs::create_dir_all(image.join("only/same")).unwrap();
        std::fs::write(tree.join("only/same/f"), b"1").unwrap();
        std::fs::write(image.join("only/same/f"), b"1").unwrap();
        std::fs::write(tree.join("lib/x/differs"), b"mine").unwrap();
        std::fs::write(image.join("lib/x/differs"), b"them").unwrap();
        drop_image_files(&tree, &image).unwrap();
        assert!(!tree.join("lib/x/libc.so.6").exists());
        assert!(tree.join("lib/x/libz.so.1").exists());
        assert!(tree.join("lib/x/differs").exists());
        assert!(!tree.join("only").exists());
        std::fs::remove_dir_all(&base).unwrap();
    }
}
