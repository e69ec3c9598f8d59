//! A capture file's bytes as the analyzer reads them: the file mapped into memory (its pages are
//! the kernel's page cache, which a capture just written or read already fills), or, for what
//! cannot be mapped (a pipe, standard input, an empty file), read into memory.
//!
//! Reading a 60 MB capture with `read` costs 60 MB of fresh memory (each page faulted in and
//! zeroed) and a copy, about a tenth of what `hvprof-analyze report` takes on a 10 M-sample
//! capture; mapping it costs neither (`cargo xtask bench`, "Analyzer throughput").

use std::fs::File;
use std::ops::Deref;
use std::path::Path;

use anyhow::{Context, Result};

/// A capture's bytes: mapped, or owned.
pub enum Capture {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Capture {
    /// The bytes of the file at `path`: mapped when it is a regular file of at least one byte,
    /// read otherwise.
    pub fn open(path: &Path) -> Result<Capture> {
        let file = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
        let meta = file
            .metadata()
            .with_context(|| format!("cannot read {}", path.display()))?;
        if meta.is_file() && meta.len() > 0 {
            // SAFETY: the mapping is read-only and lives as long as the `Capture`, which hands
            // out the bytes only through `&self`. The file is a capture this process never
            // writes. What no program can rule out is another process changing the file while
            // it is mapped (memmap2's caveat): a writer that appends (`hvprof-analyze record`,
            // an emulator's serial port) only adds bytes past the mapping, which it does not
            // see; one that truncates the file makes a later read of the lost pages a SIGBUS,
            // which ends the process before it can use a changed byte. perf, ripgrep and git
            // read their files the same way.
            let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) };
            if let Ok(map) = map {
                return Ok(Capture::Mapped(map));
            }
        }
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut &file, &mut bytes)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Ok(Capture::Owned(bytes))
    }
}

impl Default for Capture {
    fn default() -> Self {
        Capture::Owned(Vec::new())
    }
}

impl From<Vec<u8>> for Capture {
    fn from(bytes: Vec<u8>) -> Self {
        Capture::Owned(bytes)
    }
}

impl Deref for Capture {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Capture::Mapped(m) => m,
            Capture::Owned(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_mapped_and_a_pipe_or_empty_file_read() {
        let dir = std::env::temp_dir().join(format!("hvprof-capture-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("serial.log");
        let want: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&file, &want).unwrap();
        let c = Capture::open(&file).unwrap();
        assert!(matches!(c, Capture::Mapped(_)));
        assert_eq!(&*c, &want[..]);
        let empty = dir.join("empty.log");
        std::fs::write(&empty, b"").unwrap();
        let c = Capture::open(&empty).unwrap();
        assert!(matches!(c, Capture::Owned(_)));
        assert!(c.is_empty());
        // A character device (not a regular file) is read, not mapped.
        let c = Capture::open(Path::new("/dev/null")).unwrap();
        assert!(matches!(c, Capture::Owned(_)) && c.is_empty());
        let missing = Capture::open(&dir.join("missing.log"));
        assert!(
            missing
                .err()
                .is_some_and(|e| e.to_string().contains("cannot read"))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
