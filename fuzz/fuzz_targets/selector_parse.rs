//! Arbitrary text into the SQL92 selector compiler, then the compiled selector against a
//! message.
//!
//! Checks: no panic and no stack overflow on any input (the parser bounds length,
//! the tree's height and IN lists); a selector that compiles evaluates without panicking,
//! on a 256 KiB stack, and to the same answer twice (evaluation has no state).
#![no_main]

use libfuzzer_sys::fuzz_target;
use triad_core::selector::{Fields, Selector, Value};

struct Msg;

impl Fields for Msg {
    fn field(&self, name: &str) -> Option<Value> {
        match name.len() % 6 {
            0 => None,
            1 => Some(Value::Int(name.len() as i64 - 3)),
            2 => Some(Value::Float(name.len() as f64 / 3.0)),
            3 => Some(Value::Str(name.repeat(3))),
            4 => Some(Value::Bool(name.len() % 4 == 0)),
            _ => Some(Value::Int(i64::MAX)),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(sel) = Selector::parse(&text) {
        // on a small stack: the tree's height is bounded, so evaluation (recursive, on a
        // tokio worker in the broker) must fit in far less than a worker's 2 MiB
        std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || {
                let a = sel.evaluate(&Msg);
                assert_eq!(a, sel.evaluate(&Msg));
                assert_eq!(sel.matches(&Msg), a == Some(true));
            })
            .expect("spawn")
            .join()
            .expect("evaluation panicked");
    }
});
