//! The `triad` broker binary. In progress.
fn main() {}
