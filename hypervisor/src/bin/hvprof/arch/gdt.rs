//! Per-CPU GDT and TSS, with separate interrupt stacks (IST) for NMI, #DF and #MC so that those
//! three always run on a known-good stack (Intel SDM Vol. 3A §7.14.5, "Interrupt Stack Table").

use x86_64::VirtAddr;
use x86_64::instructions::segmentation::{CS, DS, ES, FS, GS, SS, Segment};
use x86_64::instructions::tables::load_tss;
use x86_64::registers::segmentation::SegmentSelector;
use x86_64::structures::gdt::{Descriptor, GlobalDescriptorTable};
use x86_64::structures::tss::TaskStateSegment;

/// IST slots (1-based in the IDT, 0-based in the TSS array).
pub const IST_NMI: u16 = 0;
pub const IST_DOUBLE_FAULT: u16 = 1;
pub const IST_MACHINE_CHECK: u16 = 2;

pub const IST_STACK_SIZE: usize = 16 * 1024;

/// What one CPU needs: its GDT, its TSS and the IST stacks the TSS points at.
#[repr(C, align(16))]
pub struct CpuTables {
    gdt: GlobalDescriptorTable,
    tss: TaskStateSegment,
    stacks: [[u8; IST_STACK_SIZE]; 3],
}

/// The boot CPU's tables: static, so they exist before the heap does.
static mut BSP_TABLES: CpuTables = CpuTables {
    gdt: GlobalDescriptorTable::new(),
    tss: TaskStateSegment::new(),
    stacks: [[0; IST_STACK_SIZE]; 3],
};

/// The selectors and TSS base of this CPU, for the VMCS host-state area.
#[derive(Clone, Copy, Debug)]
pub struct Selectors {
    pub code: u16,
    pub data: u16,
    pub tss: u16,
    pub tss_base: u64,
}

/// Loads the boot CPU's GDT and TSS; returns their selectors (for `percpu::init`, which makes it
/// pCPU 0). Call once, on the boot CPU, before the IDT is loaded.
pub fn init_bsp() -> Selectors {
    // SAFETY: called once on the boot CPU before any other CPU runs, so this is the only
    // reference to BSP_TABLES that will ever exist.
    let tables: &'static mut CpuTables = unsafe { &mut *core::ptr::addr_of_mut!(BSP_TABLES) };
    load(tables)
}

/// Builds and loads the GDT and TSS of application processor `index` (in memory from the frame
/// allocator: they live as long as the machine); returns their selectors (for `percpu::init`).
pub fn init_ap() -> Selectors {
    let size = core::mem::size_of::<CpuTables>() as u64;
    let Some(addr) = crate::memory::alloc_zeroed(size, 4096) else {
        // Without its own IST stacks this CPU cannot take an NMI safely: stop it.
        crate::power::halt_forever();
    };
    let ptr = addr as *mut CpuTables;
    // SAFETY: a fresh, zeroed, page-aligned block from the frame allocator, owned by this CPU
    // alone from now on. The stacks are valid zeroed; the GDT and TSS are written before the
    // reference is made (not built on this CPU's small stack).
    let tables: &'static mut CpuTables = unsafe {
        core::ptr::addr_of_mut!((*ptr).gdt).write(GlobalDescriptorTable::new());
        core::ptr::addr_of_mut!((*ptr).tss).write(TaskStateSegment::new());
        &mut *ptr
    };
    load(tables)
}

fn load(tables: &'static mut CpuTables) -> Selectors {
    for (slot, stack) in tables.stacks.iter().enumerate() {
        let top = VirtAddr::from_ptr(stack.as_ptr()) + IST_STACK_SIZE as u64;
        tables.tss.interrupt_stack_table[slot] = top;
    }
    let tss: &'static TaskStateSegment = &tables.tss;
    let tss_base = tss as *const TaskStateSegment as u64;
    let gdt = &mut tables.gdt;
    let code = gdt.append(Descriptor::kernel_code_segment());
    let data = gdt.append(Descriptor::kernel_data_segment());
    let tss_sel = gdt.append(Descriptor::tss_segment(tss));
    let gdt: &'static GlobalDescriptorTable = gdt;
    gdt.load();
    // SAFETY: the selectors index the GDT just loaded: a 64-bit code segment, a data segment and
    // an available 64-bit TSS (SDM Vol. 3A §3.4.5, §8.2.3). The TSS is not busy: it was never
    // loaded before.
    unsafe {
        CS::set_reg(code);
        SS::set_reg(data);
        DS::set_reg(data);
        ES::set_reg(data);
        FS::set_reg(SegmentSelector(0));
        GS::set_reg(SegmentSelector(0));
        load_tss(tss_sel);
    }
    Selectors {
        code: code.0,
        data: data.0,
        tss: tss_sel.0,
        tss_base,
    }
}
