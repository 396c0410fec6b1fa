//! The gRPC code checked in under `src/rpc/generated/` is exactly what the vendored protos under
//! `proto/` compile to. Compiled here with `protox` (a protobuf compiler in Rust) and tonic's
//! generator, so neither building nor this check needs `protoc`.
//!
//! `DISTLOCK_REGENERATE=1 cargo test -p distlock-etcd --test generated_code` rewrites the checked-in
//! files (after updating the protos, or tonic/prost).
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::Path;

/// The protos whose types and client stubs distlock-etcd uses. Their imports (google/api,
/// grpc-gateway options, versionpb) carry options only and generate nothing we use.
const PROTOS: &[&str] = &[
    "etcd/api/mvccpb/kv.proto",
    "etcd/api/authpb/auth.proto",
    "etcd/api/etcdserverpb/rpc.proto",
    "etcd/server/etcdserver/api/v3lock/v3lockpb/v3lock.proto",
];

#[test]
fn checked_in_grpc_code_matches_the_vendored_protos() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let proto = root.join("proto");
    let mut descriptors = protox::compile(PROTOS.iter().map(|p| proto.join(p)), [&proto])
        .expect("compile the protos");
    descriptors
        .file
        .retain(|file| PROTOS.contains(&file.name()));
    let out = tempfile::tempdir().expect("a temp dir");
    tonic_prost_build::configure()
        .build_server(false)
        .build_transport(false)
        .emit_rerun_if_changed(false)
        // prost's codec with smaller per-call buffers (`src/rpc/codec.rs`).
        .codec_path("crate::rpc::codec::SmallCodec")
        .out_dir(out.path())
        .compile_fds(descriptors)
        .expect("generate the Rust code");

    let checked_in = root.join("src/rpc/generated");
    let regenerate = std::env::var_os("DISTLOCK_REGENERATE").is_some_and(|v| v == "1");
    let mut generated: Vec<_> = std::fs::read_dir(out.path())
        .expect("list the generated files")
        .map(|e| e.expect("a generated file").file_name())
        .collect();
    generated.sort();
    assert!(!generated.is_empty(), "nothing was generated");
    let mut stale = Vec::new();
    for name in &generated {
        let fresh = std::fs::read_to_string(out.path().join(name)).expect("read a generated file");
        let target = checked_in.join(name);
        let current = std::fs::read_to_string(&target).unwrap_or_default();
        if current != fresh {
            if regenerate {
                std::fs::write(&target, &fresh).expect("write a generated file");
            } else {
                stale.push(target.display().to_string());
            }
        }
    }
    // Every checked-in generated file is still produced (mod.rs is hand-written).
    for entry in std::fs::read_dir(&checked_in).expect("list the checked-in files") {
        let name = entry.expect("a checked-in file").file_name();
        if name != "mod.rs" && !generated.contains(&name) {
            stale.push(format!(
                "{} (no longer generated)",
                checked_in.join(&name).display()
            ));
        }
    }
    assert!(
        stale.is_empty(),
        "the checked-in gRPC code is stale: {stale:?}; run `DISTLOCK_REGENERATE=1 cargo test -p distlock-etcd --test generated_code` and commit the result"
    );
}
