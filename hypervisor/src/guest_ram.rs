//! A VM's memory as the hypervisor reads it: guest-physical `[0, size)` at one host address, read
//! with every access bounded to it. In the hypervisor that is the VM's own frames, identity-mapped
//! (its EPT maps the same range, so a read through this is a read of the VM's own memory and
//! nothing else); on the host, the tests' buffers.

/// A VM's memory: guest-physical `[0, size)` at host address `hpa`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestRam {
    hpa: u64,
    size: u64,
}

impl GuestRam {
    /// The memory at host address `hpa`, `size` bytes.
    ///
    /// # Safety
    /// `[hpa, hpa + size)` must be memory this program may read for as long as the value, a copy
    /// of it, or an address it gave (`host`, [`RamWord`]) is used; others may write it
    /// meanwhile (the reads are of plain integers and bytes, and any value is valid).
    #[inline]
    pub const unsafe fn new(hpa: u64, size: u64) -> Self {
        GuestRam { hpa, size }
    }

    /// Its host address.
    #[inline]
    pub fn hpa(&self) -> u64 {
        self.hpa
    }

    /// Its size in bytes.
    #[inline]
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The host address of the `len` bytes at guest-physical `gpa`, when they all lie inside.
    #[inline(always)]
    pub fn host(&self, gpa: u64, len: u64) -> Option<u64> {
        let end = gpa.checked_add(len)?;
        (end <= self.size).then(|| self.hpa + gpa)
    }

    /// The host address of the 4 KiB page that holds guest-physical `gpa`, when it lies wholly
    /// inside: a page walk's check, one comparison.
    #[inline(always)]
    pub fn host_page(&self, gpa: u64) -> Option<u64> {
        let page = gpa & !0xfff;
        (page < self.size & !0xfff).then(|| self.hpa + page)
    }

    /// Copies `buf.len()` bytes at guest-physical `gpa`; `false` (and nothing copied) when they
    /// are not all inside.
    #[inline]
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> bool {
        let Some(at) = self.host(gpa, buf.len() as u64) else {
            return false;
        };
        // SAFETY: `[at, at + len)` lies inside `[hpa, hpa + size)` (checked), which `new`'s
        // caller made readable; others may write it meanwhile: the copy is of bytes.
        unsafe { core::ptr::copy_nonoverlapping(at as *const u8, buf.as_mut_ptr(), buf.len()) };
        true
    }

    /// The 8 bytes at guest-physical `gpa` as a [`RamWord`], or `None` outside.
    #[inline(always)]
    pub fn word(&self, gpa: u64) -> Option<RamWord> {
        self.host(gpa, 8).map(RamWord)
    }

    /// The 8 bytes at guest-physical `gpa` (little-endian), or `None` outside.
    #[inline(always)]
    pub fn read_u64(&self, gpa: u64) -> Option<u64> {
        self.word(gpa).map(RamWord::read)
    }
}

/// 8 bytes of a VM's memory, by their host address, found inside it once ([`GuestRam::word`])
/// and then read with no bound check: a word a Linux guest's every sample reads
/// (`profiler::guest_walk::SameTask`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamWord(u64);

impl RamWord {
    /// The word's value now (little-endian).
    #[inline(always)]
    pub fn read(self) -> u64 {
        // SAFETY: `GuestRam::word` made this address with its 8 bytes inside a `GuestRam`, which
        // its maker keeps readable while its addresses are used (`GuestRam::new`); others may
        // write it meanwhile, and any bit pattern is a valid u64; the read is unaligned-safe.
        unsafe { core::ptr::read_unaligned(self.0 as *const u64) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_read_stays_inside() {
        let mem: &'static mut [u8] = alloc::vec![0u8; 64].leak();
        for (i, b) in mem.iter_mut().enumerate() {
            *b = i as u8;
        }
        // SAFETY: a leaked buffer, readable for the program's life.
        let ram = unsafe { GuestRam::new(mem.as_ptr() as u64, 64) };
        assert_eq!(ram.read_u64(0), Some(0x0706_0504_0302_0100));
        assert_eq!(ram.read_u64(56), Some(0x3f3e_3d3c_3b3a_3938));
        assert_eq!(ram.read_u64(57), None);
        assert_eq!(ram.read_u64(u64::MAX - 3), None);
        let mut b = [0u8; 4];
        assert!(ram.read(60, &mut b) && b == [60, 61, 62, 63]);
        assert!(!ram.read(61, &mut b));
        assert_eq!(ram.word(3).map(RamWord::read), ram.read_u64(3));
        assert_eq!(ram.host(0, 65), None);
        // Pages: only whole ones inside.
        // SAFETY: as above.
        let big = unsafe { GuestRam::new(0x10_0000, 0x2800) };
        assert_eq!(big.host_page(0x1fff), Some(0x10_1000));
        assert_eq!(big.host_page(0x2000), None, "half a page inside");
        assert_eq!(big.host_page(u64::MAX), None);
    }
}
