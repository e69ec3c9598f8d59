//! The call chains of a profile, named: each distinct frame address in its naming context once
//! (a [`CallSite`]), each distinct function once (a [`CallFrame`]), each distinct pair of named
//! chains once (a [`CallStack`], which every stack with chains points to).
//!
//! A frame of a chain is a return address: it is named as the call instruction before it
//! (`addr - 1`, as perf does), in the symbols that name the sample's leaf: the hypervisor's ELF
//! for host frames; for guest frames the VM's image, or for a Linux guest its kernel (an address
//! in the kernel half) or its process's files (in the user half). A hypervisor sample taken on
//! a vCPU's exit has that vCPU's guest chain: the guest RIP at the exit (an instruction, named
//! as it is), then its callers.
//!
//! [`crate::model::whole_stack`] lays a sample's stack out with them.

use rustc_hash::FxHashMap as HashMap;

use crate::model::interner::Interner;
use crate::model::samples::{ChainEnd, Samples, Stack, What};
use crate::naming::namer::{Namer, ProcessKey};

/// A function of a call chain, named.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallFrame {
    /// `Hypervisor` for the hypervisor's frames, `GuestKernel` or `GuestUser` for a guest's.
    pub what: What,
    /// Its name (`[unknown] 0x...` without symbols for it).
    pub function: String,
    /// The file it is in (`hvprof` for the hypervisor).
    pub module: String,
}

/// One frame address of a chain in its naming context: the address as the chain holds it,
/// its function (index into [`Calls::frames`]), and its offset from the function's start when
/// the symbols give the start (`perf script`'s `function+0x12`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallSite {
    /// The address as the chain holds it (a return address, or an exit's RIP).
    pub addr: u64,
    /// Its function: index into [`Calls::frames`].
    pub frame: u32,
    /// `addr`'s offset from the function's start, when the symbols give the start.
    pub offset: Option<u64>,
}

/// A sample's chains, named: indexes into [`Calls::sites`], innermost first, and how each walk
/// ended. A hypervisor sample's guest chain is its exit cause (`Stack::exit_cause`); a guest
/// sample has no host chain.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallStack {
    /// The hypervisor's frames.
    pub host: Vec<u32>,
    /// How the hypervisor's walk ended (`NotWalked` without a host chain).
    pub host_end: ChainEnd,
    /// The guest's frames.
    pub guest: Vec<u32>,
    /// How the guest's walk ended (`NotWalked` without a guest chain).
    pub guest_end: ChainEnd,
}

impl Default for CallStack {
    fn default() -> Self {
        CallStack {
            host: Vec::new(),
            host_end: ChainEnd::NotWalked,
            guest: Vec::new(),
            guest_end: ChainEnd::NotWalked,
        }
    }
}

/// The named call chains of a profile.
#[derive(Debug, Clone)]
pub struct Calls {
    /// Distinct functions (by what, function, module).
    pub frames: Vec<CallFrame>,
    /// Distinct frame addresses in their naming context.
    pub sites: Vec<CallSite>,
    /// Distinct named chains; index 0 is the sample without chains.
    pub stacks: Vec<CallStack>,
}

impl Default for Calls {
    fn default() -> Self {
        Calls {
            frames: Vec::new(),
            sites: Vec::new(),
            stacks: vec![CallStack::default()],
        }
    }
}

impl Calls {
    /// A stack's named chains (the empty one without).
    pub fn of(&self, s: &Stack) -> &CallStack {
        self.stacks.get(s.calls as usize).unwrap_or(&self.stacks[0])
    }

    /// A site's function.
    pub fn frame(&self, site: u32) -> &CallFrame {
        &self.frames[self.sites[site as usize].frame as usize]
    }
}

/// What names a frame address: the hypervisor's symbols, or a VM's guest context (for a
/// Linux guest's user address also its process and address space).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum SiteKey {
    Host {
        addr: u64,
        exact: bool,
    },
    Guest {
        vm: u16,
        user: bool,
        addr: u64,
        exact: bool,
        process: Option<ProcessKey>,
        space: u64,
    },
}

impl SiteKey {
    fn addr(&self) -> u64 {
        match *self {
            SiteKey::Host { addr, .. } | SiteKey::Guest { addr, .. } => addr,
        }
    }
}

/// The site keys of a stack's chains, innermost first (host, guest); the guest frames of a
/// sample that has no guest context (idle, the hypervisor for no VM) and the host frames of a
/// guest sample are left out.
fn site_keys(namer: &Namer, s: &Stack, samples: &Samples) -> (Vec<SiteKey>, Vec<SiteKey>) {
    let Some(c) = samples.chain(s.chain) else {
        return (Vec::new(), Vec::new());
    };
    let guest_ctx = matches!(s.what, What::GuestKernel | What::GuestUser) || s.exit_cause;
    let host: Vec<SiteKey> = if guest_ctx && !s.exit_cause {
        Vec::new()
    } else {
        c.host
            .iter()
            .map(|&addr| SiteKey::Host { addr, exact: false })
            .collect()
    };
    let guest: Vec<SiteKey> = if guest_ctx {
        let linux = namer.is_linux(s.vm);
        c.guest
            .iter()
            .enumerate()
            .map(|(i, &addr)| {
                let user = if linux {
                    !crate::naming::linux::is_kernel_address(addr)
                } else {
                    s.what == What::GuestUser
                };
                let by_process = linux && user;
                SiteKey::Guest {
                    vm: s.vm,
                    user,
                    addr,
                    exact: s.exit_cause && i == 0,
                    process: if by_process { s.process } else { None },
                    space: if by_process {
                        namer.address_space(s.vm, s.cr3)
                    } else {
                        0
                    },
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    (host, guest)
}

/// Names one site.
fn name_site(namer: &Namer, k: &SiteKey) -> (CallFrame, Option<u64>) {
    // A return address is named as the call before it; its offset is the address's own.
    let looked = |addr: u64, exact: bool| if exact { addr } else { addr.wrapping_sub(1) };
    let (what, sym, shift) = match *k {
        SiteKey::Host { addr, exact } => (
            What::Hypervisor,
            namer.hypervisor_symbol(looked(addr, exact)),
            u64::from(!exact),
        ),
        SiteKey::Guest {
            vm,
            user,
            addr,
            exact,
            process,
            space,
        } => {
            let task = process.and_then(|p| namer.task_label(p));
            (
                if user {
                    What::GuestUser
                } else {
                    What::GuestKernel
                },
                namer.guest_symbol(vm, user, looked(addr, exact), space, task),
                u64::from(!exact),
            )
        }
    };
    (
        CallFrame {
            what,
            function: sym.function,
            module: sym.module,
        },
        sym.offset.map(|o| o.wrapping_add(shift)),
    )
}

/// Names the chains of the stacks `needed` accepts: returns them and each stack's index into
/// `Calls::stacks` (0 for the others and those without chains).
pub fn name(
    samples: &Samples,
    namer: &Namer,
    needed: impl Fn(&Stack) -> bool,
) -> (Calls, Vec<u32>) {
    let mut calls = Calls::default();
    let stacks = samples.stacks();
    if !samples.has_chains() {
        return (calls, vec![0; stacks.len()]);
    }
    // Every distinct site, named once, on every core. (Each stack's site keys are made again
    // below rather than kept: memory stays with the distinct sites.)
    let mut site_ids: HashMap<SiteKey, u32> = HashMap::default();
    let mut distinct: Vec<SiteKey> = Vec::new();
    for s in stacks.iter().filter(|s| s.chain != 0 && needed(s)) {
        let (host, guest) = site_keys(namer, s, samples);
        for k in host.iter().chain(&guest) {
            site_ids.entry(*k).or_insert_with(|| {
                distinct.push(*k);
                (distinct.len() - 1) as u32
            });
        }
    }
    let chunks: Vec<&[SiteKey]> = distinct.chunks(4096).collect();
    let named: Vec<(CallFrame, Option<u64>)> = crate::model::par::par_map(chunks, |c| {
        c.iter().map(|k| name_site(namer, k)).collect::<Vec<_>>()
    })
    .into_iter()
    .flatten()
    .collect();
    let mut frame_ids: HashMap<CallFrame, u32> = HashMap::default();
    for (k, (frame, offset)) in distinct.iter().zip(named) {
        let next = calls.frames.len() as u32;
        let frame = *frame_ids.entry(frame.clone()).or_insert_with(|| {
            calls.frames.push(frame);
            next
        });
        calls.sites.push(CallSite {
            addr: k.addr(),
            frame,
            offset,
        });
    }
    // Each stack's named chains, each distinct one kept once (the first, no chain, is 0).
    let mut interned: Interner<CallStack> = Interner::with_capacity(1);
    interned.number(&CallStack::default(), CallStack::default);
    let out = stacks
        .iter()
        .map(|s| {
            if s.chain == 0 || !needed(s) {
                return 0;
            }
            let Some(c) = samples.chain(s.chain) else {
                return 0;
            };
            let (host, guest) = site_keys(namer, s, samples);
            let ids = |ks: &[SiteKey]| ks.iter().map(|k| site_ids[k]).collect::<Vec<u32>>();
            let guest_ctx = matches!(s.what, What::GuestKernel | What::GuestUser) || s.exit_cause;
            let cs = CallStack {
                host: ids(&host),
                host_end: if guest_ctx && !s.exit_cause {
                    ChainEnd::NotWalked
                } else {
                    c.host_end
                },
                guest: ids(&guest),
                guest_end: if guest_ctx {
                    c.guest_end
                } else {
                    ChainEnd::NotWalked
                },
            };
            // Kept (cloned) when first seen only.
            interned.number(&cs, || cs.clone()).0
        })
        .collect();
    calls.stacks = interned.values;
    (calls, out)
}

/// The name of the frame a truncated chain gets as its outermost: `[truncated: depth limit]`
/// or `[truncated: bad frame]` (`None` for a chain that was not cut).
pub fn truncated_name(end: ChainEnd) -> Option<&'static str> {
    match end {
        ChainEnd::DepthLimit => Some("[truncated: depth limit]"),
        ChainEnd::BadFrame => Some("[truncated: bad frame]"),
        ChainEnd::Complete | ChainEnd::NotWalked => None,
    }
}

/// The frame between an exit cause's guest frames and the hypervisor's: `[exit: CPUID]`.
pub fn exit_frame_name(exit: u16) -> String {
    format!("[exit: {}]", crate::naming::namer::exit_name(exit))
}
