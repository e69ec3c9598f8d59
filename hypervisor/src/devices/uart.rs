//! A virtual 16550A UART (one per VM, at COM1's ports 0x3f8-0x3ff). Output is line-buffered: a
//! complete line (or a full buffer) is handed back to the caller, which prints it on the
//! hypervisor console with the VM's name in front (docs/GUEST-ABI.md, "Devices"). A byte written
//! is sent at once, so the transmitter is always ready; input queued by the host
//! ([`Uart::push_input`]) is received. Interrupts follow the data sheet's IIR priorities and reach
//! the PC's IRQ 4 through MCR.OUT2 ([`Uart::irq`]); small test guests that never enable them see
//! the plain always-ready UART of guest ABI v1.
//!
//! Datasheet: National Semiconductor PC16550D UART with FIFOs: section 8 "Registers" (Table II,
//! the register summary), 8.3 "Line Control Register", 8.4 "Typical Clock Circuits" (divisor
//! latches), 8.5 "Line Status Register", 8.6 "FIFO Control Register", 8.7 "Interrupt
//! Identification Register" (Table IV, priorities and reset control), 8.8 "Interrupt Enable
//! Register", 8.9 "Modem Control Register" (loopback), 8.10 "Modem Status Register", 8.11
//! "Scratchpad Register", 8.12 "FIFO Interrupt Mode Operation".
//!
//! Model choices:
//! - The receiver takes its bytes from a host-side buffer of [`INPUT_MAX`] bytes: with FIFOs the
//!   guest sees up to 16 at a time against the trigger level; without, one at a time in RBR.
//!   Data below the trigger level reports the character timeout (IIR 0x0c) at once, not after
//!   four character times. A byte pushed into a full buffer is lost with an overrun (LSR.OE).
//! - No parity, framing or break errors ever occur; LSR bit 7 reads 0.
//! - Outside loopback the modem inputs read as a connected terminal: CTS, DSR and DCD set.
//! - In loopback the modem-control output pins go inactive, and OUT2 with them: the PC's IRQ 4
//!   is not driven, though IIR still reports interrupts (8.9).

/// Offsets from the base port.
pub const THR_RBR_DLL: u8 = 0;
pub const IER_DLM: u8 = 1;
pub const IIR_FCR: u8 = 2;
pub const LCR: u8 = 3;
pub const MCR: u8 = 4;
pub const LSR: u8 = 5;
pub const MSR: u8 = 6;
pub const SCR: u8 = 7;

/// LSR: transmitter holding register empty | transmitter empty.
pub const LSR_READY: u8 = 0x60;
const LSR_DR: u8 = 0x01;
const LSR_OE: u8 = 0x02;
const LCR_DLAB: u8 = 0x80;
/// IIR values (Table IV): none, line status, received data, character timeout, THRE, modem
/// status; bits 7-6 when the FIFOs are enabled.
const IIR_NONE: u8 = 0x01;
const IIR_RLS: u8 = 0x06;
const IIR_RDA: u8 = 0x04;
const IIR_TIMEOUT: u8 = 0x0c;
const IIR_THRE: u8 = 0x02;
const IIR_MSI: u8 = 0x00;
const IIR_FIFO: u8 = 0xc0;
/// IER bits.
const IER_ERBFI: u8 = 0x01;
const IER_ETBEI: u8 = 0x02;
const IER_ELSI: u8 = 0x04;
const IER_EDSSI: u8 = 0x08;
/// MCR bits.
const MCR_OUT2: u8 = 0x08;
const MCR_LOOP: u8 = 0x10;
/// MSR inputs outside loopback: DCD, DSR, CTS.
const MSR_CONNECTED: u8 = 0xb0;
const MSR_CTS: u8 = 0x10;
const MSR_DSR: u8 = 0x20;
const MSR_RI: u8 = 0x40;
const MSR_DCD: u8 = 0x80;

pub const LINE_MAX: usize = 200;
/// The host-side receive buffer.
pub const INPUT_MAX: usize = 64;
/// The receiver FIFO's depth.
const FIFO_DEPTH: usize = 16;

#[derive(Clone, Debug)]
pub struct Uart {
    ier: u8,
    lcr: u8,
    mcr: u8,
    scr: u8,
    dll: u8,
    dlm: u8,
    /// FCR bit 0.
    fifo: bool,
    /// The receiver trigger level in bytes (FCR bits 7-6).
    trigger: usize,
    /// The THRE interrupt: set when THR empties (at once after a write) or when ETBEI is
    /// enabled; cleared by reading IIR while it is the source.
    thre: bool,
    /// LSR.OE, cleared by reading LSR.
    overrun: bool,
    /// MSR bits 3-0 (DCTS, DDSR, TERI, DDCD), cleared by reading MSR.
    msr_delta: u8,
    rx: [u8; INPUT_MAX],
    rx_head: usize,
    rx_len: usize,
    line: [u8; LINE_MAX],
    len: usize,
    /// Bytes the guest sent in all.
    pub bytes_out: u64,
}

impl Default for Uart {
    fn default() -> Self {
        Self {
            ier: 0,
            lcr: 0x03,
            mcr: 0,
            scr: 0,
            dll: 1,
            dlm: 0,
            fifo: false,
            trigger: 1,
            thre: false,
            overrun: false,
            msr_delta: 0,
            rx: [0; INPUT_MAX],
            rx_head: 0,
            rx_len: 0,
            line: [0; LINE_MAX],
            len: 0,
            bytes_out: 0,
        }
    }
}

impl Uart {
    fn dlab(&self) -> bool {
        self.lcr & LCR_DLAB != 0
    }

    fn loopback(&self) -> bool {
        self.mcr & MCR_LOOP != 0
    }

    /// MSR bits 7-4: in loopback, DTR → DSR, RTS → CTS, OUT1 → RI, OUT2 → DCD (8.9).
    fn modem_inputs(&self) -> u8 {
        if !self.loopback() {
            return MSR_CONNECTED;
        }
        let m = self.mcr;
        let bit = |mcr_bit: u8, msr_bit: u8| if m & mcr_bit != 0 { msr_bit } else { 0 };
        bit(0x01, MSR_DSR) | bit(0x02, MSR_CTS) | bit(0x04, MSR_RI) | bit(0x08, MSR_DCD)
    }

    /// Received bytes the guest can see now (the FIFO holds 16).
    fn rx_visible(&self) -> usize {
        if self.fifo {
            self.rx_len.min(FIFO_DEPTH)
        } else {
            self.rx_len.min(1)
        }
    }

    fn rx_push(&mut self, byte: u8) {
        if self.rx_len == INPUT_MAX {
            self.overrun = true;
        } else {
            self.rx[(self.rx_head + self.rx_len) % INPUT_MAX] = byte;
            self.rx_len += 1;
        }
    }

    fn rx_pop(&mut self) -> Option<u8> {
        (self.rx_len > 0).then(|| {
            let b = self.rx[self.rx_head];
            self.rx_head = (self.rx_head + 1) % INPUT_MAX;
            self.rx_len -= 1;
            b
        })
    }

    fn rx_clear(&mut self) {
        self.rx_head = 0;
        self.rx_len = 0;
    }

    /// The highest-priority enabled interrupt pending (Table IV), as IIR bits 3-0.
    fn source(&self) -> Option<u8> {
        let ier = self.ier;
        let rx = self.rx_visible();
        if ier & IER_ELSI != 0 && self.overrun {
            Some(IIR_RLS)
        } else if ier & IER_ERBFI != 0 && rx > 0 {
            Some(if !self.fifo || rx >= self.trigger {
                IIR_RDA
            } else {
                IIR_TIMEOUT
            })
        } else if ier & IER_ETBEI != 0 && self.thre {
            Some(IIR_THRE)
        } else if ier & IER_EDSSI != 0 && self.msr_delta != 0 {
            Some(IIR_MSI)
        } else {
            None
        }
    }

    /// The UART's interrupt line as a PC wires it: INTR gated by MCR.OUT2 onto IRQ 4, inactive
    /// in loopback (the OUT2 pin is forced inactive).
    pub fn irq(&self) -> bool {
        self.mcr & MCR_OUT2 != 0 && !self.loopback() && self.source().is_some()
    }

    /// A byte from the host's side of the line for the guest to receive. Dropped in loopback (the
    /// receiver input is disconnected) and, with an overrun, when [`INPUT_MAX`] bytes wait.
    pub fn push_input(&mut self, byte: u8) {
        if !self.loopback() {
            self.rx_push(byte);
        }
    }

    /// How many more bytes `push_input` can take without an overrun.
    pub fn input_room(&self) -> usize {
        INPUT_MAX - self.rx_len
    }

    /// A guest write to `base + offset`. Returns a line to print when one is complete.
    pub fn write(&mut self, offset: u8, value: u8) -> Option<&[u8]> {
        match (offset & 7, self.dlab()) {
            (THR_RBR_DLL, false) => {
                // Sent at once: the holding register is empty again right away.
                self.thre = true;
                if self.loopback() {
                    self.rx_push(value);
                    return None;
                }
                return self.send(value);
            }
            (THR_RBR_DLL, true) => self.dll = value,
            (IER_DLM, false) => {
                // Enabling the THRE interrupt while THR is empty raises it.
                if value & IER_ETBEI != 0 && self.ier & IER_ETBEI == 0 {
                    self.thre = true;
                }
                self.ier = value & 0x0f;
            }
            (IER_DLM, true) => self.dlm = value,
            (IIR_FCR, _) => self.fcr(value),
            (LCR, _) => self.lcr = value,
            (MCR, _) => {
                let before = self.modem_inputs();
                self.mcr = value & 0x1f;
                let after = self.modem_inputs();
                let changed = before ^ after;
                let delta = |msr_bit: u8, delta_bit: u8| {
                    if changed & msr_bit != 0 { delta_bit } else { 0 }
                };
                // TERI on RI's trailing edge only.
                let teri = if before & MSR_RI != 0 && after & MSR_RI == 0 {
                    0x04
                } else {
                    0
                };
                self.msr_delta |= delta(MSR_CTS, 0x01) | delta(MSR_DSR, 0x02) | teri;
                self.msr_delta |= delta(MSR_DCD, 0x08);
            }
            (SCR, _) => self.scr = value,
            _ => {} // LSR, MSR: read-only.
        }
        None
    }

    /// FCR (8.6): bit 0 enables the FIFOs (a change clears them); bits 1 and 2 clear the
    /// receiver and transmitter FIFOs; bits 7-6 the receiver trigger level. With bit 0 clear the
    /// other bits are not programmed.
    fn fcr(&mut self, value: u8) {
        let enable = value & 0x01 != 0;
        if enable != self.fifo {
            self.rx_clear();
        }
        self.fifo = enable;
        if !enable {
            return;
        }
        if value & 0x02 != 0 {
            self.rx_clear();
        }
        self.trigger = [1, 4, 8, 14][usize::from(value >> 6)];
    }

    /// A guest read of `base + offset`. Reading RBR takes a received byte, IIR clears a THRE
    /// interrupt it reports, LSR clears the overrun, MSR the modem-status deltas.
    pub fn read(&mut self, offset: u8) -> u8 {
        match (offset & 7, self.dlab()) {
            (THR_RBR_DLL, false) => self.rx_pop().unwrap_or(0),
            (THR_RBR_DLL, true) => self.dll,
            (IER_DLM, false) => self.ier,
            (IER_DLM, true) => self.dlm,
            (IIR_FCR, _) => {
                let fifo = if self.fifo { IIR_FIFO } else { 0 };
                match self.source() {
                    Some(IIR_THRE) => {
                        // Table IV: reading IIR when THRE is the source resets it.
                        self.thre = false;
                        IIR_THRE | fifo
                    }
                    Some(s) => s | fifo,
                    None => IIR_NONE | fifo,
                }
            }
            (LCR, _) => self.lcr,
            (MCR, _) => self.mcr,
            (LSR, _) => {
                let dr = if self.rx_len > 0 { LSR_DR } else { 0 };
                let oe = if core::mem::take(&mut self.overrun) {
                    LSR_OE
                } else {
                    0
                };
                LSR_READY | dr | oe
            }
            (MSR, _) => self.modem_inputs() | core::mem::take(&mut self.msr_delta),
            _ => self.scr,
        }
    }

    /// A byte for the transmitter (what a THR write does; the PRINT hypercall uses it too).
    pub fn send(&mut self, byte: u8) -> Option<&[u8]> {
        self.bytes_out += 1;
        match byte {
            b'\n' => return Some(self.take()),
            b'\r' => {}
            _ => {
                self.line[self.len] = byte;
                self.len += 1;
                if self.len == LINE_MAX {
                    return Some(self.take());
                }
            }
        }
        None
    }

    fn take(&mut self) -> &[u8] {
        let n = core::mem::take(&mut self.len);
        &self.line[..n]
    }

    /// What is left of an unterminated line (at VM stop).
    pub fn flush(&mut self) -> Option<&[u8]> {
        (self.len > 0).then(|| self.take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn send(u: &mut Uart, s: &[u8]) -> Vec<Vec<u8>> {
        s.iter()
            .filter_map(|&b| u.write(THR_RBR_DLL, b).map(<[u8]>::to_vec))
            .collect()
    }

    #[test]
    fn lines_and_ready() {
        let mut u = Uart::default();
        assert_eq!(u.read(LSR), LSR_READY);
        assert_eq!(send(&mut u, b"hello\r\nwor"), vec![b"hello".to_vec()]);
        assert_eq!(u.flush(), Some(&b"wor"[..]));
        assert_eq!(u.flush(), None);
        assert_eq!(u.bytes_out, 10);
    }

    #[test]
    fn long_lines_are_cut() {
        let mut u = Uart::default();
        let out = send(&mut u, &[b'x'; LINE_MAX + 5]);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].len(), LINE_MAX);
        assert_eq!(u.flush().map(<[u8]>::len), Some(5));
    }

    #[test]
    fn registers() {
        let mut u = Uart::default();
        u.write(SCR, 0x5a);
        assert_eq!(u.read(SCR), 0x5a);
        // Divisor latch: with DLAB set, offsets 0 and 1 are DLL/DLM and send nothing.
        u.write(LCR, 0x83);
        assert_eq!(u.write(THR_RBR_DLL, b'\n'), None);
        u.write(IER_DLM, 0);
        assert_eq!((u.read(THR_RBR_DLL), u.read(IER_DLM)), (b'\n', 0));
        u.write(LCR, 0x03);
        assert_eq!(u.read(IIR_FCR), IIR_NONE);
        assert_eq!(u.bytes_out, 0);
    }

    #[test]
    fn a_polling_guest_never_sees_an_interrupt() {
        let mut u = Uart::default();
        u.write(MCR, 0x0b); // DTR, RTS, OUT2 as a BIOS leaves it
        send(&mut u, b"no interrupts\n");
        assert!(!u.irq());
        assert_eq!(u.read(IIR_FCR), IIR_NONE);
    }

    /// What Linux's 8250 `autoconfig` does to a port, and what it concludes.
    #[test]
    fn linux_autoconfig_finds_a_16550a() {
        let mut u = Uart::default();
        // Existence test: IER holds 0 and 0x0f.
        u.write(IER_DLM, 0);
        assert_eq!(u.read(IER_DLM) & 0x0f, 0);
        u.write(IER_DLM, 0x0f);
        assert_eq!(u.read(IER_DLM) & 0x0f, 0x0f);
        u.write(IER_DLM, 0);
        // Loopback test: MCR = LOOP | OUT2 | RTS gives MSR 0x90 (DCD | CTS).
        let save_mcr = u.read(MCR);
        u.write(MCR, 0x1a);
        assert_eq!(u.read(MSR) & 0xf0, 0x90);
        u.write(MCR, save_mcr);
        // EFR probe: LCR 0xbf, a write to offset 2 (FCR here), then FIFO enable.
        u.write(LCR, 0xbf);
        u.write(IIR_FCR, 0);
        u.write(LCR, 0);
        u.write(IIR_FCR, 0x01);
        assert_eq!(u.read(IIR_FCR) >> 6, 3, "a 16550A");
        // autoconfig_16550a: with DLAB set, offset 2 is not an EFR reading 0.
        u.write(LCR, 0x80);
        assert_ne!(u.read(IIR_FCR), 0);
        u.write(LCR, 0xbf);
        assert_ne!(u.read(IIR_FCR), 0);
        // Not a 16750: IIR bit 5 never reports a 64-byte FIFO.
        u.write(LCR, 0);
        u.write(IIR_FCR, 0x21);
        assert_eq!(u.read(IIR_FCR) >> 5, 6);
        // Not an XScale: IER bit 6 (UUE) does not stick.
        u.write(IER_DLM, 0x40);
        assert_eq!(u.read(IER_DLM) & 0x40, 0);
        u.write(IER_DLM, 0);
        assert_eq!(u.bytes_out, 0);
    }

    /// serial8250_do_startup's THRE test: a real 16550 reasserts THRE when ETBEI is enabled
    /// again, so Linux does not fall back to its polling timer (UART_BUG_THRE).
    #[test]
    fn thre_is_reasserted_for_linux_startup() {
        let mut u = Uart::default();
        u.write(IIR_FCR, 0x07);
        u.write(MCR, 0x0b);
        u.write(IER_DLM, IER_ETBEI);
        let iir1 = u.read(IIR_FCR);
        u.write(IER_DLM, 0);
        u.write(IER_DLM, IER_ETBEI);
        let iir = u.read(IIR_FCR);
        u.write(IER_DLM, 0);
        assert_eq!(iir1, 0xc2);
        assert_eq!(iir, 0xc2);
    }

    #[test]
    fn transmit_by_interrupt() {
        let mut u = Uart::default();
        u.write(IIR_FCR, 0x01);
        u.write(MCR, 0x0b); // OUT2: the line reaches IRQ 4
        assert!(!u.irq());
        u.write(IER_DLM, IER_ETBEI);
        assert!(u.irq(), "enabling ETBEI with THR empty interrupts");
        // The handler reads IIR: THRE was the source, so it is cleared.
        assert_eq!(u.read(IIR_FCR), 0xc2);
        assert!(!u.irq());
        assert_eq!(u.read(IIR_FCR), 0xc1);
        // It writes a byte: THR empties again at once.
        assert_eq!(u.write(THR_RBR_DLL, b'x'), None);
        assert!(u.irq());
        // Nothing more to send: the driver disables ETBEI.
        u.write(IER_DLM, 0);
        assert!(!u.irq());
        // OUT2 gates the line.
        u.write(IER_DLM, IER_ETBEI);
        u.write(MCR, 0x03);
        assert!(!u.irq());
        assert_eq!(u.read(IIR_FCR), 0xc2, "IIR reports it all the same");
        assert_eq!(u.flush(), Some(&b"x"[..]));
    }

    #[test]
    fn receive_without_fifos() {
        let mut u = Uart::default();
        u.write(MCR, 0x0b);
        u.write(IER_DLM, IER_ERBFI);
        assert_eq!(u.read(LSR) & LSR_DR, 0);
        u.push_input(b'a');
        u.push_input(b'b');
        assert!(u.irq());
        assert_eq!(u.read(LSR), LSR_READY | LSR_DR);
        assert_eq!(u.read(IIR_FCR), IIR_RDA);
        assert_eq!(u.read(THR_RBR_DLL), b'a');
        assert_eq!(u.read(IIR_FCR), IIR_RDA, "the next byte moves into RBR");
        assert_eq!(u.read(THR_RBR_DLL), b'b');
        assert_eq!(u.read(LSR), LSR_READY);
        assert!(!u.irq());
        assert_eq!(u.input_room(), INPUT_MAX);
    }

    #[test]
    fn receive_with_fifo_trigger_levels() {
        let mut u = Uart::default();
        u.write(IIR_FCR, 0x81); // FIFOs, trigger 8
        u.write(MCR, 0x0b);
        u.write(IER_DLM, IER_ERBFI | IER_ETBEI);
        assert_eq!(u.read(IIR_FCR), 0xc2);
        for b in b"abc" {
            u.push_input(*b);
        }
        // Below the trigger level: the character timeout, above THRE in priority.
        u.write(THR_RBR_DLL, b'-');
        assert_eq!(u.read(IIR_FCR), 0xcc);
        for b in b"defgh" {
            u.push_input(*b);
        }
        assert_eq!(u.read(IIR_FCR), 0xc4);
        let got: Vec<u8> = (0..8).map(|_| u.read(THR_RBR_DLL)).collect();
        assert_eq!(got, b"abcdefgh");
        // Received data drained: THRE (set by the byte sent) shows again.
        assert_eq!(u.read(IIR_FCR), 0xc2);
        // FCR bit 1 clears the receiver.
        u.push_input(b'z');
        u.write(IIR_FCR, 0x83);
        assert_eq!(u.read(LSR) & LSR_DR, 0);
    }

    #[test]
    fn overrun_is_a_line_status_interrupt() {
        let mut u = Uart::default();
        u.write(MCR, 0x08);
        u.write(IER_DLM, IER_ELSI | IER_ERBFI | IER_ETBEI);
        for i in 0..=INPUT_MAX {
            u.push_input(i as u8);
        }
        assert_eq!(u.input_room(), 0);
        assert_eq!(u.read(IIR_FCR), IIR_RLS, "highest priority");
        assert_eq!(u.read(LSR), LSR_READY | LSR_DR | LSR_OE);
        // Reading LSR cleared it: received data is next, then THRE.
        assert_eq!(u.read(IIR_FCR), IIR_RDA);
        for _ in 0..INPUT_MAX {
            u.read(THR_RBR_DLL);
        }
        assert_eq!(u.read(IIR_FCR), IIR_THRE);
        assert_eq!(u.read(IIR_FCR), IIR_NONE);
    }

    #[test]
    fn loopback() {
        let mut u = Uart::default();
        u.write(MCR, 0x0b);
        assert_eq!(u.read(MSR), MSR_CONNECTED);
        u.write(IER_DLM, IER_ERBFI | IER_EDSSI);
        // Loopback with DTR only: DSR follows DTR, CTS and DCD drop.
        u.write(MCR, 0x11);
        assert_eq!(u.read(IIR_FCR), IIR_MSI);
        assert!(!u.irq(), "OUT2 is inactive in loopback");
        assert_eq!(
            u.read(MSR),
            MSR_DSR | 0x01 | 0x08,
            "DSR, delta CTS, delta DCD"
        );
        assert_eq!(u.read(MSR), MSR_DSR);
        // OUT1 → RI: TERI on the trailing edge only.
        u.write(MCR, 0x15);
        assert_eq!(u.read(MSR) & 0x0f, 0);
        u.write(MCR, 0x11);
        assert_eq!(u.read(MSR), MSR_DSR | 0x04);
        // A byte sent comes back, unprinted; host input is disconnected.
        u.push_input(b'h');
        assert_eq!(u.write(THR_RBR_DLL, b'\n'), None);
        assert_eq!(u.bytes_out, 0);
        assert_eq!(u.read(IIR_FCR), IIR_RDA);
        assert_eq!(u.read(THR_RBR_DLL), b'\n');
        assert_eq!(u.read(LSR) & LSR_DR, 0);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Write(u8, u8),
        Read(u8),
        Push(u8),
        Send(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..16, any::<u8>()).prop_map(|(o, v)| Op::Write(o, v)),
            (0u8..16).prop_map(Op::Read),
            any::<u8>().prop_map(Op::Push),
            any::<u8>().prop_map(Op::Send),
        ]
    }

    proptest! {
        /// No sequence of accesses panics; the transmitter is always ready; lines never hold a
        /// newline nor exceed LINE_MAX; the interrupt line never rises without OUT2.
        #[test]
        fn any_sequence(ops in prop::collection::vec(op(), 0..400)) {
            let mut u = Uart::default();
            for op in ops {
                let line = match op {
                    Op::Write(o, v) => u.write(o, v).map(<[u8]>::to_vec),
                    Op::Read(o) => {
                        let v = u.read(o);
                        if o & 7 == LSR {
                            prop_assert_eq!(v & LSR_READY, LSR_READY);
                        }
                        None
                    }
                    Op::Push(b) => { u.push_input(b); None }
                    Op::Send(b) => u.send(b).map(<[u8]>::to_vec),
                };
                if let Some(line) = line {
                    prop_assert!(line.len() <= LINE_MAX && !line.contains(&b'\n'));
                }
                if u.irq() {
                    prop_assert!(u.mcr & MCR_OUT2 != 0);
                }
            }
        }
    }
}
