//! A vCPU's floating-point and vector state (x87, SSE, and AVX where the CPU has it), switched in
//! full whenever a pCPU changes vCPU, with its own XCR0.
//!
//! VMX switches none of this (SDM Vol. 3C §28.5: the VM exit loads no x87/SSE/AVX register and
//! XCR0 is not in the VMCS). A guest controls its CR4.OSXSAVE and asks for XCR0 values through
//! XSETBV (which exits), so without switching, one VM's YMM upper halves and XCR0 would be the
//! next VM's (and the host's). Where the CPU has XSAVE, the state is saved and restored with
//! XSAVE/XRSTOR over every component the hypervisor lets a guest enable ([`guest_xcr0_max`]),
//! with XCR0 set to that set around them, so nothing survives a switch whatever the guests' own
//! XCR0 values (SDM Vol. 1 §13.7-§13.8: XSAVE/XRSTOR act on RFBM = XCR0 AND EDX:EAX); then the
//! guest's XCR0 goes back in. Without XSAVE, FXSAVE/FXRSTOR switch the x87/SSE state (SDM Vol. 1
//! §10.5.1).
//!
//! Components beyond AVX (MPX, AVX-512, PKRU, AMX, ...) are never allowed in a guest's XCR0
//! (XSETBV of them injects #GP), so no state of theirs can leak either.

use core::sync::atomic::{AtomicU64, Ordering};

/// XCR0 bit 0: x87 state (always set).
pub const XCR0_X87: u64 = 1 << 0;
/// XCR0 bit 1: SSE state (XMM registers, MXCSR).
pub const XCR0_SSE: u64 = 1 << 1;
/// XCR0 bit 2: AVX state (upper halves of the YMM registers).
pub const XCR0_AVX: u64 = 1 << 2;

/// Bytes of a vCPU's save area: the XSAVE legacy region (512), header (64) and the AVX component
/// (256 at offset 576 in the standard format, SDM Vol. 1 §13.4.3), rounded up; FXSAVE uses the
/// first 512.
pub const AREA_BYTES: usize = 1024;

/// What guests may put in XCR0 (0: XSAVE not available; set once by [`init`]).
static GUEST_XCR0_MAX: AtomicU64 = AtomicU64::new(0);

/// Finds what the CPU supports; call once before any vCPU runs (CR4.OSXSAVE set where XSAVE
/// exists).
pub fn init() {
    let cpuid = raw_cpuid::CpuId::new();
    let xsave = cpuid.get_feature_info().is_some_and(|f| f.has_xsave());
    let max = if xsave {
        // The standard format puts AVX at offset 576, 256 bytes (CPUID.(EAX=0DH,ECX=2)): inside
        // `AREA_BYTES` on every CPU.
        let avx = cpuid
            .get_extended_state_info()
            .is_some_and(|s| s.xcr0_supports_avx_256());
        XCR0_X87 | XCR0_SSE | if avx { XCR0_AVX } else { 0 }
    } else {
        0
    };
    GUEST_XCR0_MAX.store(max, Ordering::Relaxed);
}

/// The boot log's line on how guest FPU state is switched.
pub fn describe() -> &'static str {
    match guest_xcr0_max() {
        0 => "vcpu: guest x87/SSE state switched with FXSAVE/FXRSTOR (no XSAVE)",
        m if m & XCR0_AVX != 0 => {
            "vcpu: guest x87/SSE/AVX state and XCR0 switched with XSAVE/XRSTOR; XCR0 x87|SSE|AVX allowed"
        }
        _ => "vcpu: guest x87/SSE state and XCR0 switched with XSAVE/XRSTOR; XCR0 x87|SSE allowed",
    }
}

/// The XCR0 bits a guest may set (0 without XSAVE: XSETBV is then #UD in the guest anyway).
pub fn guest_xcr0_max() -> u64 {
    GUEST_XCR0_MAX.load(Ordering::Relaxed)
}

/// Whether `value` is an XCR0 a guest may have (SDM Vol. 2D, XSETBV: x87 always, AVX only with
/// SSE, no bit the CPU or the hypervisor does not support).
pub fn valid_guest_xcr0(value: u64) -> bool {
    value & XCR0_X87 != 0
        && (value & XCR0_AVX == 0 || value & XCR0_SSE != 0)
        && value & !guest_xcr0_max() == 0
}

/// A vCPU's saved state, 64-byte aligned as XSAVE needs (FXSAVE needs 16).
#[repr(C, align(64))]
pub struct FpuState {
    area: [u8; AREA_BYTES],
    /// The guest's XCR0 (1 at reset, SDM Vol. 1 §13.3).
    pub xcr0: u64,
}

impl FpuState {
    /// The state after reset: x87 and SSE in their initial state (FCW 0x37F, MXCSR 0x1F80), the
    /// XSAVE header zero (every component in its initial configuration), XCR0 = 1.
    pub fn initial() -> Self {
        let mut area = [0u8; AREA_BYTES];
        area[0..2].copy_from_slice(&0x037fu16.to_le_bytes());
        area[24..28].copy_from_slice(&0x1f80u32.to_le_bytes());
        FpuState {
            area,
            xcr0: XCR0_X87,
        }
    }

    /// Puts this state and the guest's XCR0 on the CPU (before the vCPU runs).
    pub fn load(&self) {
        let max = guest_xcr0_max();
        if max == 0 {
            // SAFETY: `area` is 16-byte aligned and holds an FXSAVE image (initial or saved);
            // CR4.OSFXSR is set (vmx_root::enable).
            unsafe {
                core::arch::asm!("fxrstor64 [{}]", in(reg) self.area.as_ptr(), options(nostack))
            };
            return;
        }
        // SAFETY: CR4.OSXSAVE is set where `max` is not 0 (vmx_root::enable); `max` and the
        // guest's XCR0 are valid XCR0 values (`valid_guest_xcr0`, checked at every XSETBV); the
        // area is 64-byte aligned, in the standard format with a header XSAVE wrote or that is
        // zero (valid for XRSTOR, SDM Vol. 1 §13.8.1), and large enough for `max`'s components.
        unsafe {
            xsetbv(max);
            core::arch::asm!(
                "xrstor64 [{}]",
                in(reg) self.area.as_ptr(),
                in("eax") max as u32,
                in("edx") (max >> 32) as u32,
                options(nostack)
            );
            xsetbv(self.xcr0);
        }
    }

    /// Takes the state off the CPU (after the vCPU ran); XCR0 is left with every component the
    /// guests may use, which the hypervisor itself never touches.
    pub fn save(&mut self) {
        let max = guest_xcr0_max();
        if max == 0 {
            // SAFETY: `area` is 512 bytes or more, 16-byte aligned; CR4.OSFXSR is set.
            unsafe {
                core::arch::asm!("fxsave64 [{}]", in(reg) self.area.as_mut_ptr(), options(nostack))
            };
            return;
        }
        // SAFETY: as in `load`: OSXSAVE set, `max` valid, the area aligned and large enough.
        unsafe {
            xsetbv(max);
            core::arch::asm!(
                "xsave64 [{}]",
                in(reg) self.area.as_mut_ptr(),
                in("eax") max as u32,
                in("edx") (max >> 32) as u32,
                options(nostack)
            );
        }
    }
}

/// Writes XCR0.
///
/// # Safety
/// CR4.OSXSAVE is set and `value` is a valid XCR0 for this CPU (else #GP).
pub unsafe fn xsetbv(value: u64) {
    // SAFETY: the caller's contract; XCR0 only selects the state XSAVE-managed instructions may
    // use, which the hypervisor does not use.
    unsafe {
        core::arch::asm!(
            "xsetbv",
            in("ecx") 0,
            in("eax") value as u32,
            in("edx") (value >> 32) as u32,
            options(nostack)
        )
    };
}
