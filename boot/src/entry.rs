//! The Multiboot2 header and the 32→64-bit trampoline.
//!
//! GRUB loads the hypervisor ELF (one loadable segment at 16 MiB, see `hypervisor/linker.ld`) and
//! jumps to `_start` in 32-bit protected mode with paging off, `EAX` = the Multiboot2 magic and
//! `EBX` = the physical address of the boot information (Multiboot2 specification 2.0, §3.3,
//! "I386 machine state"). The trampoline:
//! 1. checks that the CPU has long mode (CPUID 8000_0001h:EDX.LM) and prints a refusal on COM1 if not;
//! 2. builds identity-mapped page tables for the first 4 GiB with 2 MiB pages (Intel SDM Vol. 3A
//!    §4.5, "4-level paging");
//! 3. enables PAE, loads CR3, sets IA32_EFER.LME, enables paging (SDM Vol. 3A §10.8.5,
//!    "Initializing IA-32e Mode");
//! 4. far-returns into a 64-bit code segment, sets up the boot stack and calls
//!    `hvprof_boot_main(magic: u32, info: u32)` with both values zero-extended.
//!
//! Everything sits in one `global_asm!` block: LLVM cannot take symbol differences across separate
//! blocks in debug builds.

/// The first argument `hvprof_boot_main` receives when a Multiboot2 loader started us.
pub const MULTIBOOT2_BOOTLOADER_MAGIC: u32 = 0x36d7_6289;

/// Size of the boot stack (the boot CPU's stack until the hypervisor switches to its own).
pub const BOOT_STACK_SIZE: usize = 64 * 1024;

core::arch::global_asm!(
    r#"
    .set MB2_MAGIC, 0xE85250D6
    .set MB2_ARCH_I386, 0

    .section .multiboot2, "a"
    .balign 8
mb2_header_start:
    .long MB2_MAGIC
    .long MB2_ARCH_I386
    .long mb2_header_end - mb2_header_start
    .long 0x100000000 - (MB2_MAGIC + MB2_ARCH_I386 + (mb2_header_end - mb2_header_start))
    // End tag.
    .short 0
    .short 0
    .long 8
mb2_header_end:

    .section .text.boot32, "ax"
    .code32
    .global _start
_start:
    cli
    cld
    mov esp, offset boot_stack_top
    mov edi, eax
    mov esi, ebx

    // Long mode present? CPUID 8000_0000h must reach 8000_0001h, whose EDX bit 29 is LM.
    mov eax, 0x80000000
    cpuid
    cmp eax, 0x80000001
    jb 90f
    mov eax, 0x80000001
    cpuid
    test edx, 0x20000000
    jz 90f

    // PD entries: 4 page directories, 512 entries each, 2 MiB pages (P | RW | PS).
    mov ecx, 0
    mov ebx, offset boot_pd
1:
    mov eax, ecx
    shl eax, 21
    or eax, 0x83
    mov [ebx + ecx * 8], eax
    mov eax, ecx
    shr eax, 11
    mov [ebx + ecx * 8 + 4], eax
    inc ecx
    cmp ecx, 2048
    jne 1b

    // PDPT entries 0..3 point at the four page directories (P | RW).
    mov ecx, 0
    mov ebx, offset boot_pdpt
2:
    mov eax, ecx
    shl eax, 12
    add eax, offset boot_pd
    or eax, 0x3
    mov [ebx + ecx * 8], eax
    mov dword ptr [ebx + ecx * 8 + 4], 0
    inc ecx
    cmp ecx, 4
    jne 2b

    // PML4[0] -> PDPT.
    mov eax, offset boot_pdpt
    or eax, 0x3
    mov ebx, offset boot_pml4
    mov [ebx], eax
    mov dword ptr [ebx + 4], 0

    // CR4.PAE, CR3, IA32_EFER.LME, CR0.PG (SDM Vol. 3A §10.8.5).
    mov eax, cr4
    or eax, 0x20
    mov cr4, eax
    mov eax, offset boot_pml4
    mov cr3, eax
    mov ecx, 0xC0000080
    rdmsr
    or eax, 0x100
    wrmsr
    mov eax, cr0
    or eax, 0x80000001
    mov cr0, eax

    lgdt [boot_gdt_ptr]
    // A far return into the 64-bit code selector (load the target into a register first: LLVM
    // assembles `push offset sym` in 32-bit code as a 16-bit push).
    push 0x08
    mov eax, offset boot_long_mode
    push eax
    retf

    // No long mode: say so on COM1 (polling LSR.THRE) and halt.
90:
    mov esi, offset boot_no_long_mode
91:
    mov al, [esi]
    test al, al
    jz 93f
    mov dx, 0x3FD
92:
    in al, dx
    test al, 0x20
    jz 92b
    mov al, [esi]
    mov dx, 0x3F8
    out dx, al
    inc esi
    jmp 91b
93:
    cli
    hlt
    jmp 93b

    .code64
    .type boot_long_mode, @function
boot_long_mode:
    mov ax, 0x10
    mov ds, ax
    mov es, ax
    mov ss, ax
    xor ax, ax
    mov fs, ax
    mov gs, ax
    mov rsp, offset boot_stack_top
    // Writing a 32-bit register zero-extends: EDI = magic, ESI = boot-info address.
    mov edi, edi
    mov esi, esi
    xor ebp, ebp
    call hvprof_boot_main
4:
    cli
    hlt
    jmp 4b
    // Sized, so that a call chain's outermost frame (the return into it) is named.
    .size boot_long_mode, . - boot_long_mode

    .section .rodata.boot32, "a"
boot_no_long_mode:
    .asciz "hvprof: refused: this CPU has no long mode (x86-64)\r\n"
    .balign 8
boot_gdt:
    .quad 0
    .quad 0x00AF9A000000FFFF
    .quad 0x00CF92000000FFFF
boot_gdt_end:
boot_gdt_ptr:
    .short boot_gdt_end - boot_gdt - 1
    .quad boot_gdt

    .section .bss.boot32, "aw", @nobits
    .balign 4096
    .global boot_pml4
boot_pml4:
    .skip 4096
boot_pdpt:
    .skip 4096
boot_pd:
    .skip 4096 * 4
    .balign 16
boot_stack_bottom:
    .skip {stack_size}
    .global boot_stack_top
boot_stack_top:
"#,
    stack_size = const BOOT_STACK_SIZE,
);
