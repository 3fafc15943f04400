//! What a failing test prints: each log under a header, and the failure itself again at the end
//! of every log. A lab test's logs print while it unwinds, after its panic message, and can run
//! to thousands of lines; whoever reads only the tail of the output (CI keeps the last lines)
//! still sees what failed.

use std::sync::{Mutex, Once};

/// The message of the last panic in this process, once [`record_panics`] ran.
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// From now on, every panic's message is kept for [`print_log`] (and printed as before).
/// Called by whatever starts something whose log a failing test prints.
pub fn record_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("(a panic with no message)");
            let place = info.location().map(|l| format!(" at {l}")).unwrap_or_default();
            let thread = std::thread::current().name().unwrap_or("unnamed").to_owned();
            *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(format!("thread '{thread}' panicked{place}:\n{message}"));
            default(info);
        }));
    });
}

/// Prints `log` to stderr under a header naming `what`, then the failure that got it printed.
pub fn print_log(what: &str, log: &str) {
    let failure = LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let failure = failure.map(|f| format!("\n(the failure: {f})")).unwrap_or_default();
    eprintln!("----- {what} -----\n{log}\n----- end of {what} -----{failure}");
}
