//! The codec of the generated client stubs: prost's, with smaller per-request buffers.
//!
//! Tonic allocates a fresh encode buffer and a fresh decode buffer of `buffer_size` for every call
//! (8 KiB each by default) and grows them as a message needs. distlock's requests and replies are a few
//! hundred bytes, so a held lock's acquire made ~16 KiB of short-lived blocks per call, thousands at
//! once with many acquires in flight: the allocator kept the holes they left between the held locks'
//! long-lived blocks (issue 9's resident memory per held lock). A larger message still fits: the
//! buffers grow as before.

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec};
use tonic_prost::ProstCodec;

/// The initial size of a call's encode and decode buffers.
pub(crate) const BUFFER_BYTES: usize = 512;
/// How much a stream batches before it yields (tonic's default).
const YIELD_THRESHOLD: usize = 32 * 1024;

/// [`ProstCodec`] with [`BUFFER_BYTES`] buffers (the generated stubs make it with `default()`).
#[derive(Debug, Clone)]
pub(crate) struct SmallCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SmallCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

fn settings() -> BufferSettings {
    BufferSettings::new(BUFFER_BYTES, YIELD_THRESHOLD)
}

impl<T, U> Codec for SmallCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <ProstCodec<T, U> as Codec>::Encoder;
    type Decoder = <ProstCodec<T, U> as Codec>::Decoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(settings())
    }
}
