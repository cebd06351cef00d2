//! [`World::exchange`](super::World::exchange): the segments checked, the
//! lists agreed on by every PE ([`super::lists`]), then the data moved by
//! each pair's transport.

use xcall_core::Platform;

use super::agreement::fields;
use super::collective::{call_record, disagreement};
use super::config::SignalOp;
use super::layout::exchange_word;
use super::lists::{self, Lists};
use super::live::Live;
use crate::cuda::WaitCode;
use crate::error::{Result, ShmemError};
use crate::transport::Transport;

impl Live {
    /// [`World::exchange`] on `stream` (`None`: this PE's own stream):
    /// the segments checked, the lists agreed on by every PE
    /// ([`Live::agree_exchange`]), then the data moved.
    ///
    /// # Safety
    /// Every outgoing `src` readable for its bytes until it completes.
    pub(super) unsafe fn exchange(
        &mut self,
        outgoing: &[Outgoing],
        incoming: &[Incoming],
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<()> {
        self.state.check()?;
        let plan = self.plan_exchange(outgoing, incoming);
        let ExchangePlan {
            copies,
            sends,
            recvs,
            to,
            from,
            tcp_sends,
            tcp_recvs,
            ..
        } = self.agree_exchange(outgoing.len() + incoming.len(), plan)?;
        let (me, n) = (self.rank, self.size);
        for &(dest, src, bytes) in &copies {
            // SAFETY: `dest` was checked to lie in one allocation of the
            // peer's mapped heap; `src` is the caller's contract.
            unsafe { self.copy(dest, src, bytes, stream) }?;
        }
        // One signal per receiver, after all of its data.
        for &q in &to {
            let word = self.peers[q].base + exchange_word(n, me);
            self.update_word(word, 1, SignalOp::Add, stream)?;
        }
        if !sends.is_empty() || !recvs.is_empty() {
            let comm = self.comm()?;
            let state = &self.state;
            // SAFETY: every receive lies in this PE's heap (checked) and
            // every send is the caller's contract; the stream is the
            // caller's or this PE's own.
            unsafe {
                comm.group(
                    &sends,
                    &recvs,
                    self.stream_or(stream).cast(),
                    self.timeout,
                    &|| state.check(),
                )
            }?;
            // A graph that captured the group keeps NCCL's finalize
            // waiting until it is destroyed: finalize counts them.
            // SAFETY: the stream is live (as above).
            unsafe {
                crate::cuda::count_while_captured(
                    self.device,
                    self.stream_or(stream),
                    comm.graphs(),
                )
            }?;
        }
        if !tcp_sends.is_empty() || !tcp_recvs.is_empty() {
            let mesh = self.mesh.as_mut().ok_or_else(|| {
                ShmemError::State("this PE has no TCP pairs; only finalize remains".into())
            })?;
            // SAFETY: every receive lies in one live allocation of this
            // PE's heap (checked) and every send is the caller's
            // contract; Host memory, this thread waits for the transfers.
            unsafe { mesh.exchange(&tcp_sends, &tcp_recvs) }?;
        }
        // One wait per sender, then its count taken back.
        for &s in &from {
            let word = self.base + exchange_word(n, s);
            match self.device.platform {
                Platform::Host => {
                    let landed = crate::error::poll(self.timeout, || {
                        self.state.check()?;
                        Ok(self.read_word(word)? != 0)
                    })?;
                    if !landed {
                        return Err(ShmemError::Timeout(format!(
                            "rank {me} waited {:?} for PE {s}'s exchange segments",
                            self.timeout
                        )));
                    }
                    self.update_word(word, u64::MAX, SignalOp::Add, None)?;
                }
                Platform::Cuda => {
                    // The kernel takes the count back once it holds.
                    let p = self.wait_params(
                        word,
                        1,
                        false,
                        u64::MAX,
                        WaitCode::Exchange { sender: s },
                    );
                    // SAFETY: `word` and the error word are this PE's
                    // internal region, mapped for the world's life.
                    unsafe {
                        crate::cuda::wait_on_stream(self.device, self.stream_or(stream), &p)
                    }?;
                }
            }
        }
        Ok(())
    }

    /// Checks every segment of an exchange before anything moves, and
    /// sorts them by transport.
    fn plan_exchange(&self, outgoing: &[Outgoing], incoming: &[Incoming]) -> Result<ExchangePlan> {
        let (me, n) = (self.rank, self.size);
        let by_nccl = |pe: usize| self.peers[pe].transport.is_nccl();
        let by_tcp = |pe: usize| self.peers[pe].transport == Transport::Tcp;
        let mut p = ExchangePlan::default();
        // Which peers got a segment (sent to / received from): one signal
        // and one wait per peer, however many segments.
        let (mut sent, mut got) = (vec![false; n], vec![false; n]);
        for o in outgoing {
            self.check_pe(o.pe)?;
            // Checked as this PE's object: allocations are symmetric.
            self.remote(o.dest, o.bytes, me, "exchange destination")?;
            p.lists.send(o.pe, o.dest - self.base, o.bytes);
            if by_nccl(o.pe) {
                // The receiver writes it.
                p.sends.push(crate::transport::nccl::Segment {
                    peer: o.pe,
                    address: o.src,
                    bytes: o.bytes,
                });
            } else if by_tcp(o.pe) {
                p.tcp_sends.push(crate::transport::tcp::Segment {
                    peer: o.pe,
                    address: o.src,
                    bytes: o.bytes,
                });
            } else {
                let dest = self.remote(o.dest, o.bytes, o.pe, "exchange destination")?;
                p.copies.push((dest, o.src, o.bytes));
                if o.pe != me && !std::mem::replace(&mut sent[o.pe], true) {
                    p.to.push(o.pe);
                }
            }
        }
        for i in incoming {
            self.check_pe(i.pe)?;
            let dest = self.remote(i.dest, i.bytes, me, "exchange receive")?;
            p.lists.receive(i.pe, i.dest - self.base, i.bytes);
            if by_nccl(i.pe) {
                p.recvs.push(crate::transport::nccl::Segment {
                    peer: i.pe,
                    address: dest,
                    bytes: i.bytes,
                });
            } else if by_tcp(i.pe) {
                p.tcp_recvs.push(crate::transport::tcp::Segment {
                    peer: i.pe,
                    address: dest,
                    bytes: i.bytes,
                });
            } else if i.pe != me && !std::mem::replace(&mut got[i.pe], true) {
                p.from.push(i.pe);
            }
        }
        Ok(p)
    }

    /// Every PE's exchange lists (or the error its checks found) through
    /// the bootstrap, as a collective call numbered with the others,
    /// before anything moves: a PE whose segments were refused fails the
    /// exchange on every PE with its error, and lists that disagree fail
    /// it on every PE with [`ShmemError::Mismatch`] ([`lists::verdict`]).
    fn agree_exchange(
        &mut self,
        segments: usize,
        plan: Result<ExchangePlan>,
    ) -> Result<ExchangePlan> {
        let seq = self.seq;
        self.seq += 1;
        let mut mine = format!("exchange\n{seq}\n{segments}\n").into_bytes();
        match &plan {
            Ok(p) => {
                mine.extend_from_slice(b"ok\n");
                mine.extend_from_slice(p.lists.encode().as_bytes());
            }
            Err(e) => {
                mine.extend_from_slice(b"err\n");
                mine.extend_from_slice(&e.encode());
            }
        }
        let all = self.boot.allgather(&mine)?;
        let mut listed = Vec::with_capacity(all.len());
        let mut refused = None;
        for (r, a) in all.iter().enumerate() {
            let record = call_record(a);
            let ours = matches!(fields(record).as_slice(),
                [w, s, _] if w == "exchange" && *s == seq.to_string());
            if !ours || record.len() == a.len() {
                return Err(disagreement(seq, &all));
            }
            let body = &a[record.len() + 1..];
            if let Some(e) = body.strip_prefix(b"err\n") {
                refused.get_or_insert((r, e));
                continue;
            }
            let lists = body
                .strip_prefix(b"ok\n")
                .and_then(|l| std::str::from_utf8(l).ok())
                .and_then(Lists::decode)
                .ok_or_else(|| {
                    ShmemError::Mismatch(format!("rank {r}'s exchange #{seq} record is malformed"))
                })?;
            listed.push(lists);
        }
        let plan = plan?;
        if let Some((r, e)) = refused {
            return Err(ShmemError::decode(r, e));
        }
        lists::verdict(seq, &listed)?;
        Ok(plan)
    }
}

/// An exchange's segments, checked and sorted by transport, with the
/// lists its PEs agree on.
#[derive(Default)]
pub(super) struct ExchangePlan {
    /// (peer address, source, bytes) of the copies to mapped peers.
    copies: Vec<(u64, u64, usize)>,
    /// NCCL sends and receives.
    sends: Vec<crate::transport::nccl::Segment>,
    recvs: Vec<crate::transport::nccl::Segment>,
    /// The mapped peers signalled once their copies are done, and those
    /// waited for.
    to: Vec<usize>,
    from: Vec<usize>,
    /// TCP sends and receives.
    tcp_sends: Vec<crate::transport::tcp::Segment>,
    tcp_recvs: Vec<crate::transport::tcp::Segment>,
    lists: Lists,
}

/// A segment this PE sends in a [`World::exchange`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outgoing {
    /// The receiving PE.
    pub pe: usize,
    /// The data: this PE's memory.
    pub src: u64,
    /// Where it lands: a symmetric address (this PE's address of the
    /// object), inside one allocation.
    pub dest: u64,
    /// Bytes.
    pub bytes: usize,
}

/// A segment this PE receives in a [`World::exchange`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Incoming {
    /// The sending PE.
    pub pe: usize,
    /// Where it lands: the symmetric address of the sender's `dest`, in
    /// this PE's heap, inside one allocation.
    pub dest: u64,
    /// Bytes.
    pub bytes: usize,
}
