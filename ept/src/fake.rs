//! Fake physical memory for host tests: frames in a map, handed out until a limit.

use std::collections::BTreeMap;

use crate::{FrameSource, PAGE_4K, PhysMem};

/// Frames at `base + n * 4 KiB`. Reading or writing outside an allocated frame panics, so a
/// walk that follows a garbage pointer fails the test.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeMem {
    pub frames: BTreeMap<u64, Box<[u64; 512]>>,
    pub next: u64,
    pub left: usize,
}

impl FakeMem {
    pub fn new(frames: usize) -> Self {
        Self {
            frames: BTreeMap::new(),
            next: 0x10_0000,
            left: frames,
        }
    }
    fn slot(&self, hpa: u64) -> (u64, usize) {
        assert_eq!(hpa % 8, 0, "unaligned access {hpa:#x}");
        (hpa & !(PAGE_4K - 1), ((hpa % PAGE_4K) / 8) as usize)
    }
}

impl FrameSource for FakeMem {
    fn alloc_zeroed_frame(&mut self) -> Option<u64> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let f = self.next;
        self.next += PAGE_4K;
        self.frames.insert(f, Box::new([0; 512]));
        Some(f)
    }
}

impl PhysMem for FakeMem {
    fn read_u64(&self, hpa: u64) -> u64 {
        let (f, i) = self.slot(hpa);
        self.frames
            .get(&f)
            .unwrap_or_else(|| panic!("read of unallocated {hpa:#x}"))[i]
    }
    fn write_u64(&mut self, hpa: u64, v: u64) {
        let (f, i) = self.slot(hpa);
        self.frames
            .get_mut(&f)
            .unwrap_or_else(|| panic!("write of unallocated {hpa:#x}"))[i] = v;
    }
}
