//! INS and OUTS, with or without REP (an I/O-instruction exit whose qualification has the string
//! bit, SDM Vol. 3C §28.2.1 Table 28-5): each element moves between the port (`io::port_in`,
//! `io::port_out`, as for IN and OUT) and the guest's memory at the linear address its segment
//! and index register give, through the guest's own page tables and with their access rights.
//! The register arithmetic (address size, direction, REP count, resumption) is
//! `hvprof_hypervisor::string_io`'s.

use super::fatal::fatal;
use super::io::{port_in, port_out};
use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::{GuestOps, must};
use crate::vm::{Stop, Vm};
use alloc::format;
use hvprof_hypervisor::devices::testdev;
use hvprof_hypervisor::profiler::guest_walk;
use hvprof_hypervisor::string_io::StringIo;
use hvprof_vmx::caps::entry::IA32E_MODE_GUEST;
use hvprof_vmx::exit::{IoAccess, IoDirection};
use hvprof_vmx::guest::InsOutsInfo;
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{Control32, Guest32, GuestNatural, ReadOnly32, Segment, VmcsExt};
use x86_64::registers::control::{Cr0Flags, Cr4Flags};
use x86_64::registers::rflags::RFlags;

/// The most elements one exit moves for a REP INS or OUTS; the guest executes the instruction
/// again for the rest, so that a long one neither holds the pCPU nor delays the vCPU's
/// interrupts.
const ELEMENTS_PER_EXIT: u64 = 4096;

/// A #PF the access raises: CR2 and the error code (SDM Vol. 3A §5.7: bit 0 a protection
/// violation, not a missing page; bit 1 a write; bit 2 at CPL 3).
struct PageFault {
    la: u64,
    error: u32,
}

/// How the guest's linear addresses of the instruction's segment reach its memory.
struct LinearSpace {
    /// The segment's base (0 in 64-bit mode but for FS and GS, SDM Vol. 1 §3.4.2.1).
    base: u64,
    /// CR3 with 4-level paging, none with paging off (linear is physical).
    cr3: Option<u64>,
    cpl: u8,
    /// CR0.WP: supervisor writes obey R/W.
    write_protect: bool,
    /// CR4.SMAP with RFLAGS.AC clear: supervisor accesses to user pages fault.
    smap: bool,
}

/// INS or OUTS: moves at most [`ELEMENTS_PER_EXIT`] elements, then updates RSI or RDI and RCX
/// and moves RIP past the instruction when it is done. An element the page tables refuse raises
/// #PF in the guest, the elements before it done (a REP instruction resumes after the fault is
/// handled). Needs the CPU's instruction information for INS/OUTS exits (IA32_VMX_BASIC[54]),
/// which gives the address size and OUTS's segment, and 4-level paging when paging is on.
pub fn handle(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs, io: &IoAccess) -> Option<Stop> {
    let input = io.direction == IoDirection::In;
    let what = if input { "INS" } else { "OUTS" };
    let info = if vm.ins_outs_info {
        vmcs.read32(ReadOnly32::ExitInstructionInfo)
            .ok()
            .and_then(|i| InsOutsInfo::decode(i, input))
    } else {
        None
    };
    let Some(info) = info else {
        return Some(fatal(
            vcpu,
            vmcs,
            format!(
                "{what} on port {:#x}: the CPU gives no instruction information for INS/OUTS exits (IA32_VMX_BASIC[54]), which string I/O needs",
                io.port
            ),
        ));
    };
    let rflags = RFlags::from_bits_truncate(must(
        vmcs.read_natural(GuestNatural::Rflags),
        "VMREAD RFLAGS",
    ));
    let space = match LinearSpace::of(vmcs, info.segment, rflags) {
        Ok(s) => s,
        Err(why) => {
            return Some(fatal(
                vcpu,
                vmcs,
                format!("{what} on port {:#x}: {why}: not emulated", io.port),
            ));
        }
    };
    let insn = StringIo {
        size: io.size,
        address_bytes: info.address_bytes,
        rep: io.rep,
        down: rflags.contains(RFlags::DIRECTION_FLAG),
    };
    let index = if input { vcpu.regs.rdi } else { vcpu.regs.rsi };
    let rcx = vcpu.regs.rcx;
    let count = insn.count(rcx, ELEMENTS_PER_EXIT);
    let size = usize::from(io.size);
    let mut moved = 0;
    let mut fault = None;
    while moved < count {
        let la = space.base.wrapping_add(insn.offset(index, moved));
        let now = crate::tsc::rdtsc();
        // The memory is checked before the port is touched: a faulting INS reads nothing.
        let at = match space.locate(vm, la, size, input) {
            Ok(at) => at,
            Err(pf) => {
                fault = Some(pf);
                break;
            }
        };
        if input {
            let bytes = port_in(vm, io.port, io.size, now).to_le_bytes();
            copy_to(at, &bytes[..size]);
        } else {
            let mut bytes = [0u8; 4];
            copy_from(at, &mut bytes[..size]);
            if let Some(stop) = port_out(vm, io.port, io.size, u32::from_le_bytes(bytes), now) {
                return Some(stop);
            }
        }
        moved += 1;
    }
    let r = &mut vcpu.regs;
    if input {
        r.rdi = insn.advance(index, moved);
    } else {
        r.rsi = insn.advance(index, moved);
    }
    if insn.rep {
        r.rcx = insn.count_down(rcx, moved);
    }
    if let Some(PageFault { la, error }) = fault {
        // The guest's CR2 is loaded at the VM entry (`vcpu::entry`).
        r.cr2 = la;
        vmcs.inject_exception(14, Some(error));
    } else if insn.done(rcx, moved) {
        vmcs.skip_instruction();
    }
    None
}

impl LinearSpace {
    fn of(vmcs: &CurrentVmcs, segment: Segment, rflags: RFlags) -> Result<Self, &'static str> {
        let read = |f: GuestNatural, what| must(vmcs.read_natural(f), what);
        let cr0 = Cr0Flags::from_bits_truncate(read(GuestNatural::Cr0, "VMREAD CR0"));
        let cr4 = Cr4Flags::from_bits_truncate(read(GuestNatural::Cr4, "VMREAD CR4"));
        let long = must(
            vmcs.read32(Control32::EntryControls),
            "VMREAD entry controls",
        ) & IA32E_MODE_GUEST
            != 0;
        let paging = cr0.contains(Cr0Flags::PAGING);
        if paging && !long {
            return Err("32-bit or PAE paging");
        }
        if paging && cr4.contains(Cr4Flags::L5_PAGING) {
            return Err("5-level paging");
        }
        let cs = must(vmcs.read32(Guest32::CsAccessRights), "VMREAD CS rights");
        let flat = long
            && hvprof_vmx::guest::long_code(cs)
            && !matches!(segment, Segment::Fs | Segment::Gs);
        let base = if flat {
            0
        } else {
            read(segment.base(), "VMREAD segment base")
        };
        let ss = must(vmcs.read32(Guest32::SsAccessRights), "VMREAD SS rights");
        Ok(LinearSpace {
            base,
            cr3: paging.then(|| read(GuestNatural::Cr3, "VMREAD CR3")),
            cpl: hvprof_vmx::guest::cpl_from_ss_access_rights(ss),
            write_protect: cr0.contains(Cr0Flags::WRITE_PROTECT),
            smap: cr4.contains(Cr4Flags::SUPERVISOR_MODE_ACCESS_PREVENTION)
                && !rflags.contains(RFlags::ALIGNMENT_CHECK),
        })
    }

    /// The host addresses of `len` bytes at linear address `la` (two pieces when they cross a
    /// page), with the access rights a read or a `write` needs; a #PF where a page is missing or
    /// refuses the access; also a #PF, as not present, where the translation leads outside the
    /// VM's memory and pc-testdev's (nothing answers there for a string access).
    fn locate(&self, vm: &Vm, la: u64, len: usize, write: bool) -> Result<[Piece; 2], PageFault> {
        let mut pieces = [Piece::default(); 2];
        let mut done = 0;
        for piece in &mut pieces {
            if done == len {
                break;
            }
            let at = la.wrapping_add(done as u64);
            let n = (len - done).min(0x1000 - (at & 0xfff) as usize);
            let gpa = self.translate(vm, at, write)?;
            let Some(host) = host_address(vm, gpa, n as u64) else {
                return Err(self.fault(at, write, false));
            };
            *piece = Piece { host, len: n };
            done += n;
        }
        Ok(pieces)
    }

    fn translate(&self, vm: &Vm, la: u64, write: bool) -> Result<u64, PageFault> {
        let Some(cr3) = self.cr3 else {
            return Ok(la & 0xffff_ffff);
        };
        let ram = vm.ram();
        let Some(leaf) = guest_walk::translate_leaf(&|gpa| ram.read_u64(gpa), cr3, la) else {
            return Err(self.fault(la, write, false));
        };
        // SDM Vol. 3A §5.6: user-mode accesses need U/S at every level, and R/W for a write;
        // supervisor writes need R/W when CR0.WP is set; with SMAP, supervisor accesses to user
        // pages fault unless RFLAGS.AC is set.
        let read_only = write && !leaf.writable();
        let refused = if self.cpl == 3 {
            !leaf.user() || read_only
        } else {
            read_only && self.write_protect || self.smap && leaf.user()
        };
        if !refused {
            Ok(leaf.gpa)
        } else {
            Err(self.fault(la, write, true))
        }
    }

    fn fault(&self, la: u64, write: bool, present: bool) -> PageFault {
        PageFault {
            la,
            error: u32::from(present) | u32::from(write) << 1 | u32::from(self.cpl == 3) << 2,
        }
    }
}

/// Bytes of guest memory at a host address.
#[derive(Clone, Copy, Default)]
struct Piece {
    host: u64,
    len: usize,
}

/// The host address of `len` bytes at guest-physical `gpa`: in the VM's memory, or in
/// pc-testdev's (`testdev::IOMEM`).
fn host_address(vm: &Vm, gpa: u64, len: u64) -> Option<u64> {
    if let Some(at) = vm.ram().host(gpa, len) {
        return Some(at);
    }
    let end = gpa.checked_add(len)?;
    let (base, size) = testdev::IOMEM;
    (vm.testdev_memory != 0 && gpa >= base && end <= base + size)
        .then(|| vm.testdev_memory + (gpa - base))
}

fn copy_to(pieces: [Piece; 2], bytes: &[u8]) {
    let mut done = 0;
    for p in pieces.iter().filter(|p| p.len != 0) {
        // SAFETY: `host_address` found [host, host + len) inside the VM's own memory (its RAM
        // or pc-testdev's, identity-mapped and never freed); the guest may access it meanwhile,
        // and any bytes are valid there.
        unsafe {
            core::ptr::copy_nonoverlapping(bytes[done..].as_ptr(), p.host as *mut u8, p.len);
        }
        done += p.len;
    }
}

fn copy_from(pieces: [Piece; 2], bytes: &mut [u8]) {
    let mut done = 0;
    for p in pieces.iter().filter(|p| p.len != 0) {
        // SAFETY: as in `copy_to`; a copy of bytes, any value valid.
        unsafe {
            core::ptr::copy_nonoverlapping(p.host as *const u8, bytes[done..].as_mut_ptr(), p.len);
        }
        done += p.len;
    }
}
