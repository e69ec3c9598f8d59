//! An initramfs: a gzip-compressed cpio archive in the SVR4 "newc" format the kernel unpacks
//! into its rootfs (`Documentation/driver-api/early-userspace/buffer-format.rst`).

use std::io::Write;

use crate::Error;

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;

#[derive(Clone, Debug)]
enum Kind {
    Dir,
    File(Vec<u8>),
    Symlink(String),
    CharDev(u32, u32),
}

#[derive(Clone, Debug)]
struct Entry {
    path: String,
    mode: u32,
    kind: Kind,
}

/// The archive's contents, in the order they are added (parents before children).
#[derive(Clone, Debug, Default)]
pub struct Initramfs {
    entries: Vec<Entry>,
}

impl Initramfs {
    pub fn new() -> Self {
        Self::default()
    }

    fn push(&mut self, path: &str, mode: u32, kind: Kind) -> Result<&mut Self, Error> {
        let path = path.trim_start_matches('/');
        if path.is_empty()
            || path
                .split('/')
                .any(|c| c.is_empty() || c == "." || c == "..")
        {
            return Err(Error::Initramfs(format!("bad path \"{path}\"")));
        }
        if self.entries.iter().any(|e| e.path == path) {
            return Err(Error::Initramfs(format!("\"{path}\" added twice")));
        }
        if let Some((parent, _)) = path.rsplit_once('/')
            && !self
                .entries
                .iter()
                .any(|e| e.path == parent && matches!(e.kind, Kind::Dir))
        {
            return Err(Error::Initramfs(format!(
                "\"{path}\": add its folder \"{parent}\" first"
            )));
        }
        self.entries.push(Entry {
            path: path.to_string(),
            mode: mode & 0o7777,
            kind,
        });
        Ok(self)
    }

    pub fn dir(&mut self, path: &str) -> Result<&mut Self, Error> {
        self.push(path, 0o755, Kind::Dir)
    }

    pub fn file(&mut self, path: &str, mode: u32, data: Vec<u8>) -> Result<&mut Self, Error> {
        if u32::try_from(data.len()).is_err() {
            return Err(Error::Initramfs(format!("\"{path}\" is larger than 4 GiB")));
        }
        self.push(path, mode, Kind::File(data))
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> Result<&mut Self, Error> {
        self.push(path, 0o777, Kind::Symlink(target.to_string()))
    }

    pub fn char_dev(
        &mut self,
        path: &str,
        mode: u32,
        major: u32,
        minor: u32,
    ) -> Result<&mut Self, Error> {
        self.push(path, mode, Kind::CharDev(major, minor))
    }

    /// The uncompressed newc archive.
    pub fn to_cpio(&self) -> Result<Vec<u8>, Error> {
        let io = |e: std::io::Error| Error::Initramfs(format!("cpio: {e}"));
        let mut out = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            let (ftype, data, nlink, rdev): (u32, &[u8], u32, (u32, u32)) = match &e.kind {
                Kind::Dir => (S_IFDIR, &[], 2, (0, 0)),
                Kind::File(d) => (S_IFREG, d, 1, (0, 0)),
                Kind::Symlink(t) => (S_IFLNK, t.as_bytes(), 1, (0, 0)),
                Kind::CharDev(ma, mi) => (S_IFCHR, &[], 1, (*ma, *mi)),
            };
            let mut w = cpio::newc::Builder::new(&e.path)
                .ino(i as u32 + 1)
                .mode(ftype | e.mode)
                .nlink(nlink)
                .rdev_major(rdev.0)
                .rdev_minor(rdev.1)
                .write(&mut out, data.len() as u32);
            w.write_all(data).map_err(io)?;
            w.finish().map_err(io)?;
        }
        cpio::newc::trailer(&mut out).map_err(io)?;
        Ok(out)
    }

    /// The gzip-compressed archive, as the kernel takes it.
    pub fn to_gzip(&self) -> Result<Vec<u8>, Error> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&self.to_cpio()?)
            .and_then(|_| gz.try_finish())
            .map_err(|e| Error::Initramfs(format!("gzip: {e}")))?;
        gz.finish()
            .map_err(|e| Error::Initramfs(format!("gzip: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archive_reads_back_with_types_and_contents() {
        let mut fs = Initramfs::new();
        fs.dir("bin").unwrap();
        fs.file("bin/busybox", 0o755, b"ELF!".to_vec()).unwrap();
        fs.symlink("bin/sh", "busybox").unwrap();
        fs.dir("dev").unwrap();
        fs.char_dev("dev/console", 0o600, 5, 1).unwrap();
        let gz = fs.to_gzip().unwrap();
        let mut cpio = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut cpio).unwrap();
        let mut rest = &cpio[..];
        let mut seen = Vec::new();
        loop {
            let mut r = cpio::newc::Reader::new(rest).unwrap();
            if r.entry().is_trailer() {
                break;
            }
            let (name, mode, rdev) = (
                r.entry().name().to_string(),
                r.entry().mode(),
                (r.entry().rdev_major(), r.entry().rdev_minor()),
            );
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut r, &mut data).unwrap();
            seen.push((name, mode, data, rdev));
            rest = r.finish().unwrap();
        }
        assert_eq!(seen.len(), 5);
        assert_eq!(seen[1].0, "bin/busybox");
        assert_eq!(seen[1].1, S_IFREG | 0o755);
        assert_eq!(seen[1].2, b"ELF!");
        assert_eq!(
            (seen[2].1 & 0o170000, &seen[2].2[..]),
            (S_IFLNK, &b"busybox"[..])
        );
        assert_eq!((seen[4].1 & 0o170000, seen[4].3), (S_IFCHR, (5, 1)));
    }

    #[test]
    fn bad_trees_are_refused() {
        let mut fs = Initramfs::new();
        let e = fs.file("bin/x", 0o755, vec![]).unwrap_err().to_string();
        assert!(e.contains("add its folder \"bin\" first"), "{e}");
        fs.dir("bin").unwrap();
        assert!(fs.dir("/bin").unwrap_err().to_string().contains("twice"));
        assert!(
            fs.dir("bin/../x")
                .unwrap_err()
                .to_string()
                .contains("bad path")
        );
    }
}
