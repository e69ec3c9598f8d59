//! The capture's ELF files found by their build ids, where the command line does not name them:
//! the hypervisor's (the log header's build id) and each VM's guest image (its entry in the
//! header), so that `hvprof-analyze report CAPTURE` names functions without `--hypervisor` or
//! `--image`.
//!
//! Where it looks, in this order (the first file with the right build id wins):
//! 1. each `--search DIR` and each folder of `HVPROF_SEARCH_PATH` (colon-separated), in the
//!    layouts of GDB (`DIR/.build-id/ab/cdef….debug`, or without `.debug`) and of debuginfod's
//!    client cache (`DIR/abcdef…/executable`, `DIR/abcdef…/debuginfo`), then the files in DIR;
//! 2. the capture's folder, and its `modules/` (a scenario's copy of its boot modules);
//! 3. every `target/` folder above the capture and above the working directory: its
//!    `x86_64-unknown-none/release` and `…/debug` (where `cargo xtask build` puts the hypervisor
//!    and the test guests).
//!
//! Only ELF files are read, each at most once.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use hvprof_samplelog::{BuildId, Header, Item, StreamDecoder};

/// What was found: the hypervisor's file, and each VM's (VM name, file).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Found {
    pub hypervisor: Option<PathBuf>,
    pub images: Vec<(String, PathBuf)>,
}

/// The capture's header (the first one in it), read from at most its first 64 MiB.
pub fn header_of(log: &Path) -> Option<Header> {
    use std::io::Read;
    let mut file = std::fs::File::open(log).ok()?;
    let mut decoder = StreamDecoder::new();
    let mut header = None;
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..64 {
        let n = file.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        decoder.feed(&buf[..n], &mut |item| {
            if let (Item::Header { header: h, .. }, None) = (&item, &header) {
                header = Some((*h).clone());
            }
        });
        if header.is_some() {
            return header;
        }
    }
    decoder.finish(&mut |item| {
        if let (Item::Header { header: h, .. }, None) = (&item, &header) {
            header = Some((*h).clone());
        }
    });
    header
}

/// The folders to look in for the capture at `log` (see the module's comment), existing ones
/// only, each once.
pub fn search_dirs(log: &Path, extra: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = extra.to_vec();
    if let Some(paths) = std::env::var_os("HVPROF_SEARCH_PATH") {
        dirs.extend(std::env::split_paths(&paths));
    }
    let folder = log
        .canonicalize()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf));
    if let Some(f) = &folder {
        dirs.push(f.clone());
        dirs.push(f.join("modules"));
    }
    let cwd = std::env::current_dir().ok();
    for start in [folder, cwd.map(|c| c.join("target"))]
        .into_iter()
        .flatten()
    {
        for dir in start.ancestors() {
            let target = if dir.file_name().is_some_and(|n| n == "target") {
                dir.to_path_buf()
            } else {
                dir.join("target")
            };
            for profile in ["release", "debug"] {
                dirs.push(target.join("x86_64-unknown-none").join(profile));
            }
        }
    }
    let mut seen = Vec::new();
    dirs.retain(|d| {
        let keep = d.is_dir() && !seen.contains(d);
        if keep {
            seen.push(d.clone());
        }
        keep
    });
    dirs
}

/// The GNU build id of the ELF file at `path`, if it is one and has one (its headers and note
/// only are read).
pub fn build_id_of(path: &Path) -> Option<Vec<u8>> {
    use object::Object;
    let mut magic = [0u8; 4];
    {
        use std::io::Read;
        std::fs::File::open(path)
            .ok()?
            .read_exact(&mut magic)
            .ok()?;
    }
    if magic != *b"\x7fELF" {
        return None;
    }
    let file = std::fs::File::open(path).ok()?;
    // SAFETY: the mapping is read-only and dropped before this returns; a file truncated by
    // another process meanwhile could fault the read (SIGBUS), as it would for any reader of a
    // build directory being rewritten; no other invariant depends on its contents.
    let map = unsafe { memmap2::Mmap::map(&file) }.ok()?;
    // Mapped, not read: only the ELF headers and the note are touched (the hypervisor's ELF
    // with its debug information is some 14 MB).
    let elf = object::File::parse(&*map).ok()?;
    elf.build_id().ok().flatten().map(<[u8]>::to_vec)
}

/// Looks for ELF files by build id in `dirs`, with the ids of every file read kept in `cache`.
struct Finder<'a> {
    dirs: &'a [PathBuf],
    cache: HashMap<PathBuf, Option<Vec<u8>>>,
}

impl Finder<'_> {
    fn id(&mut self, path: &Path) -> Option<Vec<u8>> {
        self.cache
            .entry(path.to_path_buf())
            .or_insert_with(|| build_id_of(path))
            .clone()
    }

    /// The first file whose build id is `id`.
    fn find(&mut self, id: &[u8]) -> Option<PathBuf> {
        if id.is_empty() {
            return None;
        }
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        for dir in self.dirs {
            // The build-id layouts: exact names, no scan.
            let (head, tail) = hex.split_at(2);
            for candidate in [
                dir.join(".build-id")
                    .join(head)
                    .join(format!("{tail}.debug")),
                dir.join(".build-id").join(head).join(tail),
                dir.join(&hex).join("executable"),
                dir.join(&hex).join("debuginfo"),
            ] {
                if candidate.is_file() && self.id(&candidate).as_deref() == Some(id) {
                    return Some(candidate);
                }
            }
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            let mut files: Vec<PathBuf> = entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.is_file())
                // Cargo's dependency lists and libraries are never guest images.
                .filter(|p| {
                    !p.extension().is_some_and(|e| {
                        ["d", "rlib", "rmeta", "log", "json", "iso"]
                            .contains(&e.to_str().unwrap_or(""))
                    })
                })
                .collect();
            files.sort();
            for f in files {
                if self.id(&f).as_deref() == Some(id) {
                    return Some(f);
                }
            }
        }
        None
    }
}

/// Finds the hypervisor (when `want_hypervisor`) and the guest image of each VM of `header`
/// whose build id is not among `have` (images already given), in `dirs`.
pub fn find(header: &Header, dirs: &[PathBuf], want_hypervisor: bool, have: &[Vec<u8>]) -> Found {
    let mut finder = Finder {
        dirs,
        cache: HashMap::new(),
    };
    let mut found = Found::default();
    let bytes = |b: &BuildId| b.as_bytes().to_vec();
    if want_hypervisor {
        found.hypervisor = finder.find(&bytes(&header.build_id));
    }
    for vm in header.vms.as_slice() {
        let id = bytes(&vm.image_build_id);
        if id.is_empty()
            || have.contains(&id)
            || found
                .images
                .iter()
                .any(|(_, p)| finder.id(p) == Some(id.clone()))
        {
            continue;
        }
        if let Some(path) = finder.find(&id) {
            found.images.push((vm.name.as_str().to_owned(), path));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An ELF file with a build id on this machine (a Debian program), if there is one.
    fn some_elf() -> Option<(PathBuf, Vec<u8>)> {
        ["/bin/ls", "/usr/bin/ls", "/bin/cat", "/usr/bin/env"]
            .iter()
            .map(PathBuf::from)
            .find_map(|p| build_id_of(&p).map(|id| (p, id)))
    }

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hvprof-discover-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn files_are_found_by_build_id_in_every_layout() {
        let Some((elf, id)) = some_elf() else {
            eprintln!("no ELF file with a build id here: skipped");
            return;
        };
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        // Plain folder, with files of other ids and non-ELF files beside.
        let plain = temp("plain");
        std::fs::write(plain.join("notes.txt"), b"x").unwrap();
        std::fs::copy(&elf, plain.join("guest.elf")).unwrap();
        // GDB's layout.
        let gdb = temp("gdb");
        std::fs::create_dir_all(gdb.join(".build-id").join(&hex[..2])).unwrap();
        std::fs::copy(
            &elf,
            gdb.join(".build-id")
                .join(&hex[..2])
                .join(format!("{}.debug", &hex[2..])),
        )
        .unwrap();
        // debuginfod's client cache.
        let cache = temp("debuginfod");
        std::fs::create_dir_all(cache.join(&hex)).unwrap();
        std::fs::copy(&elf, cache.join(&hex).join("executable")).unwrap();
        for (dir, want) in [
            (&plain, plain.join("guest.elf")),
            (
                &gdb,
                gdb.join(".build-id")
                    .join(&hex[..2])
                    .join(format!("{}.debug", &hex[2..])),
            ),
            (&cache, cache.join(&hex).join("executable")),
        ] {
            let dirs = [dir.clone()];
            let mut f = Finder {
                dirs: &dirs,
                cache: HashMap::new(),
            };
            assert_eq!(f.find(&id), Some(want));
            assert_eq!(f.find(&[1, 2, 3, 4]), None);
        }
        // The first folder with it wins.
        let dirs = [temp("empty"), gdb.clone(), plain.clone()];
        let mut f = Finder {
            dirs: &dirs,
            cache: HashMap::new(),
        };
        assert!(f.find(&id).unwrap().starts_with(&gdb));
        for d in [plain, gdb, cache, temp("empty")] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }

    #[test]
    fn a_scenario_capture_looks_in_its_folder_and_the_target_above_it() {
        let root = temp("tree");
        let release = root.join("target/x86_64-unknown-none/release");
        let run = root.join("target/scenarios/x");
        std::fs::create_dir_all(&release).unwrap();
        std::fs::create_dir_all(run.join("modules")).unwrap();
        std::fs::write(run.join("capture.log"), b"").unwrap();
        let dirs = search_dirs(&run.join("capture.log"), &[]);
        let canon = |p: &Path| p.canonicalize().unwrap();
        assert_eq!(dirs[0], canon(&run));
        assert_eq!(dirs[1], canon(&run.join("modules")));
        assert!(dirs.contains(&canon(&release)), "{dirs:?}");
        // An extra folder first; missing folders left out.
        let dirs = search_dirs(
            &run.join("capture.log"),
            &[release.clone(), root.join("none")],
        );
        assert_eq!(dirs[0], release);
        assert!(!dirs.contains(&root.join("none")));
        std::fs::remove_dir_all(root).unwrap();
    }
}
