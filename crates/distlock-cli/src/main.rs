//! The `distlock` command. Everything lives in the library, so the tests and `--help` share the one
//! exit-code table.

/// Counts live heap bytes only inside the hold workload's window (`distlock bench --workload hold`);
/// elsewhere it is the system allocator behind one relaxed load of an unwritten flag per call.
#[global_allocator]
static ALLOCATOR: distlock_bench::heap::CountingAllocator = distlock_bench::heap::CountingAllocator;

fn main() {
    std::process::exit(distlock_cli::main_exit_code());
}
