//! The executable file mappings of a VM's Linux processes, read once per process (the first time
//! a task of it is seen, and again after an exec gives it a new address space) and kept until
//! the end of the run, when they are sent as mapping frames. Bounded: at most `MAX_PROCESSES`
//! processes and `MAX_MAPPINGS` mappings per VM; what does not fit is counted.

use alloc::vec::Vec;

use hvprof_samplelog::Mapping;

/// The most processes a VM's table remembers.
pub const MAX_PROCESSES: usize = 1024;
/// The most mappings a VM's table keeps.
pub const MAX_MAPPINGS: usize = 4096;
/// The most guest reads one process's walk may take.
pub const WALK_READS: u32 = 20_000;

/// A VM's processes seen and their mappings.
#[derive(Default)]
pub struct ProcessMaps {
    /// (tgid, address space) of every process read.
    seen: Vec<(u32, u64)>,
    /// Their executable file mappings, in the order read.
    pub mappings: Vec<Mapping>,
    /// Processes not read (the table was full) and mappings not kept.
    pub processes_dropped: u64,
    pub mappings_dropped: u64,
    /// Walks that ended early (budget, unreadable or malformed memory).
    pub walks_cut: u64,
    /// The CR3 of the last task read (any process maps the kernel half: the module list is
    /// read through it at the end).
    pub kernel_cr3: u64,
}

impl ProcessMaps {
    /// Whether the process (`tgid` in address space `space`) is new: then it is remembered and
    /// its mappings should be read. A full table reads no more processes (counted).
    pub fn first_seen(&mut self, tgid: u32, space: u64) -> bool {
        if self.seen.contains(&(tgid, space)) {
            return false;
        }
        if self.seen.len() >= MAX_PROCESSES {
            self.processes_dropped += 1;
            return false;
        }
        self.seen.push((tgid, space));
        true
    }

    /// Keeps a mapping (counted as dropped when the table is full).
    pub fn add(&mut self, m: Mapping) {
        if self.mappings.len() < MAX_MAPPINGS {
            self.mappings.push(m);
        } else {
            self.mappings_dropped += 1;
        }
    }

    /// Processes read.
    pub fn processes(&self) -> usize {
        self.seen.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_process_is_read_once_per_address_space() {
        let mut t = ProcessMaps::default();
        assert!(t.first_seen(57, 0x1000));
        assert!(!t.first_seen(57, 0x1000));
        // exec: same tgid, new address space.
        assert!(t.first_seen(57, 0x2000));
        for i in 0..MAX_PROCESSES as u32 {
            t.first_seen(1000 + i, 0x3000);
        }
        assert_eq!(t.processes(), MAX_PROCESSES);
        assert!(!t.first_seen(99_999, 0x4000));
        assert_eq!(t.processes_dropped, 3);
        for _ in 0..MAX_MAPPINGS + 2 {
            t.add(Mapping::default());
        }
        assert_eq!((t.mappings.len(), t.mappings_dropped), (MAX_MAPPINGS, 2));
    }
}
