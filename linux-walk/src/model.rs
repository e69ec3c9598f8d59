//! A model of guest memory for host tests (feature `model`, and this crate's own tests): sparse
//! bytes; a read of any byte never written fails, as an unmapped guest page does.

extern crate std;
use std::cell::Cell;
use std::collections::BTreeMap;

/// Guest memory: the bytes written, and how many reads the walkers made.
#[derive(Default)]
pub struct Memory {
    /// Address → byte.
    pub bytes: BTreeMap<u64, u8>,
    /// Reads so far (each `GuestMemory::read` call).
    pub reads: Cell<u64>,
}

impl Memory {
    /// Writes a little-endian `u64`.
    pub fn put_u64(&mut self, addr: u64, v: u64) {
        self.put(addr, &v.to_le_bytes());
    }
    /// Writes a little-endian `u32`.
    pub fn put_u32(&mut self, addr: u64, v: u32) {
        self.put(addr, &v.to_le_bytes());
    }
    /// Writes bytes.
    pub fn put(&mut self, addr: u64, b: &[u8]) {
        for (i, &x) in b.iter().enumerate() {
            self.bytes.insert(addr + i as u64, x);
        }
    }
    /// Zero-filled memory over `[addr, addr + len)` (a structure's bytes exist).
    pub fn zero(&mut self, addr: u64, len: u64) {
        for a in addr..addr + len {
            self.bytes.entry(a).or_insert(0);
        }
    }
}

impl super::GuestMemory for Memory {
    fn read(&self, addr: u64, out: &mut [u8]) -> bool {
        self.reads.set(self.reads.get() + 1);
        for (i, o) in out.iter_mut().enumerate() {
            match addr.checked_add(i as u64).and_then(|a| self.bytes.get(&a)) {
                Some(&b) => *o = b,
                None => return false,
            }
        }
        true
    }
}
