//! The one classifier of the analyzer ([`classify`]): what a sample is (guest kernel, guest
//! user, hypervisor, idle), the address that names it, its pCPU, VM, vCPU and last exit, and
//! for a guest sample who ran (a Linux guest's task at the sample's time, else its address
//! space): the [`Key`] its stack is counted by. The first pass classifies every sample once, as
//! it is decoded; the views that read the samples again in time order get each sample's key
//! from there ([`crate::model::replay`]); `top` classifies each sample of the stream as it
//! arrives, with the tasks the stream has named so far (`live/window.rs`).

use hvprof_samplelog::{Chain, NO_VM, Sample, SampleKind};

use crate::model::samples::What;
use crate::naming::namer::{ProcessKey, Processes, TaskMemo};

/// A sample classified, before naming: the fields of [`crate::model::samples::Stack`] the
/// records give, and its process (guest samples, and exit causes: see [`Key::exit_cause`]).
/// Its chains' number is beside it (in `KeyCounts`, `StackIndex::ids`); its context is the
/// key without its address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    /// The sampled address: guest RIP (guest samples), else hypervisor RIP.
    pub addr: u64,
    /// The guest CR3 (guest samples and exit causes; 0 for the others).
    pub cr3: u64,
    /// Who ran in the guest (guest samples and exit causes).
    pub process: Option<ProcessKey>,
    pub pcpu: u16,
    /// `NO_VM` for the hypervisor's work for no VM, and idle.
    pub vm: u16,
    pub vcpu: u16,
    /// The vCPU's last exit reason (hypervisor samples; 0 for the others).
    pub exit: u16,
    pub what: What,
}

/// Every field, as four words: a context is looked up for about one sample in six (the
/// derived hash wrote each field on its own, nine writes).
impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        let (tag, process) = match self.process {
            None => (0, 0),
            Some(ProcessKey::Task(t)) => (1, u64::from(t)),
            Some(ProcessKey::Cr3(c)) => (2, c),
        };
        h.write_u64(self.addr);
        h.write_u64(self.cr3 ^ process.rotate_left(32));
        h.write_u64(
            u64::from(self.pcpu)
                | u64::from(self.vm) << 16
                | u64::from(self.vcpu) << 32
                | u64::from(self.exit) << 48,
        );
        h.write_u64(tag | (self.what as u64) << 8);
    }
}

impl Key {
    /// The key without its address.
    #[inline]
    pub(super) fn context(&self) -> Key {
        Key { addr: 0, ..*self }
    }

    /// Whether it is an exit cause: a hypervisor sample's on a vCPU's exit, with the exit's
    /// guest chain (its key has the guest context that names that chain, the guest CR3 and
    /// process).
    pub fn exit_cause(&self) -> bool {
        self.what == What::Hypervisor && self.process.is_some()
    }
}

/// The one classification of a sample: what it is, which address names it, and (guest
/// samples) who ran: with `processes`, a Linux guest's task at the sample's time (`memo`
/// remembers the last one found). A hypervisor sample on a vCPU's exit whose guest chain was
/// walked is an exit cause: its key has that vCPU's guest context too, which names the chain.
///
/// Always inlined: called, it returns the key through memory, which the caller then reads
/// back in other widths (its context, the comparison with the last one), a store-forwarding
/// stall per sample (about 6 % of the first pass on 10 M samples).
#[inline(always)]
pub fn classify(pcpu: u16, s: &Sample, processes: Option<&Processes>, memo: &mut TaskMemo) -> Key {
    // What it is, its address, and whether its key has the guest context (a guest sample, an
    // exit cause).
    let (what, addr, guest) = match s.kind {
        SampleKind::Guest if s.cpl() == 3 => (What::GuestUser, s.guest_rip, true),
        SampleKind::Guest => (What::GuestKernel, s.guest_rip, true),
        SampleKind::Hypervisor => (
            What::Hypervisor,
            s.host_rip,
            s.guest_chain != Chain::NOT_WALKED && s.vm != NO_VM,
        ),
        SampleKind::Idle => (What::Idle, s.host_rip, false),
    };
    let process = guest.then(|| match processes {
        Some(p) => p.key_memo(memo, s.vm, s.vcpu, s.tsc, s.guest_cr3),
        None => ProcessKey::Cr3(s.guest_cr3),
    });
    Key {
        addr,
        cr3: if guest { s.guest_cr3 } else { 0 },
        process,
        pcpu,
        vm: s.vm,
        vcpu: s.vcpu,
        exit: if what == What::Hypervisor {
            s.exit_reason
        } else {
            0
        },
        what,
    }
}
