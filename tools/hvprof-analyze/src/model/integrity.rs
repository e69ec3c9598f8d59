//! Signs of a damaged or forged capture: header frames that differ, blocks seen twice, task
//! frames of VMs the header does not list.

use hvprof_samplelog::Decoded;
use serde::Serialize;

/// Signs that the log was tampered with (or badly damaged): a guest that could write to the
/// capture channel might forge frames.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Integrity {
    /// Header frames that differ from the first one (the first is used).
    pub header_conflicts: u64,
    /// Blocks received twice (same pCPU and sequence number; later copies are ignored).
    pub duplicate_blocks: u64,
    /// Task frames naming a VM the header does not list.
    pub tasks_of_unknown_vms: u64,
    /// Those VMs.
    pub unknown_task_vms: Vec<u16>,
}

impl Integrity {
    /// The signs in a decoded capture.
    pub(crate) fn of(decoded: &Decoded) -> Self {
        let listed = |vm: u16| {
            decoded
                .header
                .as_ref()
                .is_some_and(|h| h.vms.iter().any(|v| v.id == vm))
        };
        let mut unknown: Vec<u16> = Vec::new();
        let mut tasks = 0u64;
        for t in decoded.tasks.iter().filter(|t| !listed(t.vm)) {
            tasks += 1;
            unknown.push(t.vm);
        }
        unknown.sort_unstable();
        unknown.dedup();
        Integrity {
            header_conflicts: decoded.header_conflicts,
            duplicate_blocks: decoded
                .pcpus
                .values()
                .fold(0, |n, p| n.saturating_add(p.duplicate_blocks)),
            tasks_of_unknown_vms: tasks,
            unknown_task_vms: unknown,
        }
    }

    /// The warnings, one per kind of sign.
    pub(crate) fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if self.header_conflicts > 0 {
            w.push(format!(
                "log integrity: {} header frame(s) differ from the first one (forged or corrupted; the first is used)",
                self.header_conflicts
            ));
        }
        if self.duplicate_blocks > 0 {
            w.push(format!(
                "log integrity: {} duplicate block(s), a pCPU's sequence number sent twice (replayed or forged; later copies ignored)",
                self.duplicate_blocks
            ));
        }
        if self.tasks_of_unknown_vms > 0 {
            const SHOWN: usize = 10;
            let mut vms: Vec<String> = self
                .unknown_task_vms
                .iter()
                .take(SHOWN)
                .map(|v| format!("vm{v}"))
                .collect();
            if self.unknown_task_vms.len() > SHOWN {
                vms.push(format!("{} more", self.unknown_task_vms.len() - SHOWN));
            }
            w.push(format!(
                "log integrity: {} task frame(s) name VMs the header does not list ({}): forged or corrupted",
                self.tasks_of_unknown_vms,
                vms.join(", ")
            ));
        }
        w
    }
}
