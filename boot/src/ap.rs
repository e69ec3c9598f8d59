//! The application-processor (AP) start-up trampoline: 16-bit real mode → 32-bit protected mode →
//! 64-bit mode, then a call into the hypervisor (Intel SDM Vol. 3A §10.4.4, "MP Initialization
//! Example", and §10.8.5, "Initializing IA-32e Mode").
//!
//! The bytes between `ap_trampoline_start` and `ap_trampoline_end` are copied to a 4 KiB page
//! below 1 MiB; the start-up IPI's vector names that page, so an AP begins at CS = page >> 4,
//! IP = 0. Before sending it, the boot CPU fills the parameter block at the end of the copy
//! ([`Params`]) and patches the two far jumps with absolute addresses (`patch`).

use core::mem::size_of;

/// What the boot CPU leaves for the AP, at offset [`PARAMS_OFFSET`] of the page.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Params {
    /// CR3 of the page tables the AP switches to (the boot CPU's identity map, below 4 GiB).
    pub cr3: u64,
    /// Top of the AP's stack.
    pub stack_top: u64,
    /// `extern "C" fn(index: u64) -> !` to call in 64-bit mode.
    pub entry: u64,
    /// The CPU's index in the hypervisor's tables.
    pub index: u64,
}

core::arch::global_asm!(
    r#"
    .section .rodata.ap_trampoline, "a"
    .balign 16
    .global ap_trampoline_start
    .global ap_trampoline_end
    .global ap_trampoline_jump32
    .global ap_trampoline_jump64
    .global ap_trampoline_gdt_ptr
    .code16
ap_trampoline_start:
    cli
    cld
    mov ax, cs
    mov ds, ax
    // EBX = the page's physical address, kept through the mode switches.
    xor ebx, ebx
    mov bx, ax
    shl ebx, 4
    lgdt [{gdt_ptr}]
    mov eax, cr0
    or eax, 1
    mov cr0, eax
    // jmp 0x08:<page + (2f - start)>, 32-bit offset (operand-size prefix); the offset is patched.
    .byte 0x66, 0xea
ap_trampoline_jump32:
    .long 0
    .short 0x08

    .code32
2:
    mov ax, 0x10
    mov ds, ax
    mov es, ax
    mov ss, ax
    mov eax, cr4
    or eax, 0x20
    mov cr4, eax
    mov eax, [ebx + {params} + {cr3}]
    mov cr3, eax
    mov ecx, 0xC0000080
    rdmsr
    or eax, 0x100
    wrmsr
    mov eax, cr0
    or eax, 0x80000000
    mov cr0, eax
    // jmp 0x18:<page + (3f - start)>; the offset is patched.
    .byte 0xea
ap_trampoline_jump64:
    .long 0
    .short 0x18

    .code64
3:
    mov ax, 0x10
    mov ds, ax
    mov es, ax
    mov ss, ax
    mov rsp, [rbx + {params} + {stack}]
    mov rdi, [rbx + {params} + {index}]
    mov rax, [rbx + {params} + {entry}]
    xor ebp, ebp
    call rax
4:
    cli
    hlt
    jmp 4b

    .org ap_trampoline_start + {gdt}
ap_trampoline_gdt:
    .quad 0
    .quad 0x00CF9A000000FFFF
    .quad 0x00CF92000000FFFF
    .quad 0x00AF9A000000FFFF
ap_trampoline_gdt_end:
    .org ap_trampoline_start + {gdt_ptr}
ap_trampoline_gdt_ptr:
    .short ap_trampoline_gdt_end - ap_trampoline_gdt - 1
    .long {gdt}
    .org ap_trampoline_start + {params}
    .skip {params_size}
ap_trampoline_end:
    .code64
"#,
    params = const PARAMS_OFFSET,
    gdt = const GDT_OFFSET,
    gdt_ptr = const GDT_PTR_OFFSET,
    params_size = const size_of::<Params>(),
    cr3 = const core::mem::offset_of!(Params, cr3),
    stack = const core::mem::offset_of!(Params, stack_top),
    index = const core::mem::offset_of!(Params, index),
    entry = const core::mem::offset_of!(Params, entry),
);

/// Where the parameter block sits in the page (the end of the copied code; checked by `image`).
pub const PARAMS_OFFSET: usize = 0x100;
/// Where the trampoline's GDT and its pseudo-descriptor sit (fixed offsets, so the 16-bit code
/// can address them with constants).
const GDT_OFFSET: usize = 0xc0;
const GDT_PTR_OFFSET: usize = 0xe0;

unsafe extern "C" {
    static ap_trampoline_start: u8;
    static ap_trampoline_end: u8;
    static ap_trampoline_jump32: u8;
    static ap_trampoline_jump64: u8;
    static ap_trampoline_gdt_ptr: u8;
}

/// The trampoline's bytes and the offsets the boot CPU patches.
pub struct Image {
    pub bytes: &'static [u8],
    pub jump32: usize,
    pub jump64: usize,
    pub gdt_ptr: usize,
    /// Offsets of the 32-bit and 64-bit entry labels.
    pub entry32: usize,
    pub entry64: usize,
}

pub fn image() -> Image {
    let start = core::ptr::addr_of!(ap_trampoline_start) as usize;
    let end = core::ptr::addr_of!(ap_trampoline_end) as usize;
    // SAFETY: both symbols bracket the trampoline in read-only data of this image.
    let bytes = unsafe { core::slice::from_raw_parts(start as *const u8, end - start) };
    let off = |p: *const u8| p as usize - start;
    let jump32 = off(core::ptr::addr_of!(ap_trampoline_jump32));
    let jump64 = off(core::ptr::addr_of!(ap_trampoline_jump64));
    // The labels follow their far-jump instructions (4-byte offset + 2-byte selector).
    Image {
        bytes,
        jump32,
        jump64,
        gdt_ptr: off(core::ptr::addr_of!(ap_trampoline_gdt_ptr)),
        entry32: jump32 + 6,
        entry64: jump64 + 6,
    }
}

impl Image {
    /// Writes the trampoline into `page` (its physical address is `base`), patched for that
    /// address, with `params`.
    pub fn install(&self, page: &mut [u8], base: u32, params: &Params) {
        assert_eq!(self.bytes.len(), PARAMS_OFFSET + size_of::<Params>());
        page[..self.bytes.len()].copy_from_slice(self.bytes);
        let put32 =
            |page: &mut [u8], at: usize, v: u32| page[at..at + 4].copy_from_slice(&v.to_le_bytes());
        put32(page, self.jump32, base + self.entry32 as u32);
        put32(page, self.jump64, base + self.entry64 as u32);
        // The GDT pointer's base: relative to the page in the image, absolute in the copy.
        let rel = u32::from_le_bytes(
            page[self.gdt_ptr + 2..self.gdt_ptr + 6]
                .try_into()
                .unwrap_or([0; 4]),
        );
        put32(page, self.gdt_ptr + 2, base + rel);
        let p = PARAMS_OFFSET;
        for (i, v) in [params.cr3, params.stack_top, params.entry, params.index]
            .iter()
            .enumerate()
        {
            page[p + 8 * i..p + 8 * i + 8].copy_from_slice(&v.to_le_bytes());
        }
    }
}
