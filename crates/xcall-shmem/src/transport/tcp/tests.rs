//! The TCP transport's unit tests.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::{hello, listen, token, Flow, Listener, Mesh, Segment};

/// Two connected loopback sockets.
fn socket_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

/// Calls `step` until it reports done, with a 20 s limit.
fn until_done(mut step: impl FnMut() -> bool) {
    let start = Instant::now();
    while !step() {
        assert!(start.elapsed() < Duration::from_secs(20), "no progress");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A length header that arrives a byte at a time is checked once
/// whole (not on its first byte), and the segment after it lands.
#[test]
fn a_header_split_over_reads_is_checked_once_whole() {
    let (mut a, b) = socket_pair();
    b.set_nonblocking(true).unwrap();
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 13 + 5) as u8).collect();
    let sent = data.clone();
    let writer = std::thread::spawn(move || {
        for byte in 1000u64.to_le_bytes() {
            a.write_all(&[byte]).unwrap();
            a.flush().unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
        a.write_all(&sent).unwrap();
        a
    });
    let mut got = vec![0u8; 1000];
    let recvs = [Segment {
        peer: 0,
        address: got.as_mut_ptr() as u64,
        bytes: got.len(),
    }];
    let mut flow = Flow::new(0, &b);
    flow.recvs.items.push(0);
    until_done(|| {
        flow.receive(1, &recvs, Duration::from_secs(5)).unwrap();
        flow.recvs.done()
    });
    drop(writer.join().unwrap());
    assert!(got == data);
}

/// A segment larger than both socket buffers: the sender's writes
/// stop at WouldBlock and go on later, and every byte arrives.
#[test]
fn a_segment_larger_than_the_socket_buffers_is_sent_in_turns() {
    let (a, mut b) = socket_pair();
    a.set_nonblocking(true).unwrap();
    let data: Vec<u8> = (0..48u32 << 20).map(|i| (i % 251) as u8).collect();
    let reader = std::thread::spawn(move || {
        // Late, so that the sender meets full buffers.
        std::thread::sleep(Duration::from_millis(200));
        let mut header = [0u8; 8];
        b.read_exact(&mut header).unwrap();
        let mut got = vec![0u8; u64::from_le_bytes(header) as usize];
        b.read_exact(&mut got).unwrap();
        got
    });
    let sends = [Segment {
        peer: 1,
        address: data.as_ptr() as u64,
        bytes: data.len(),
    }];
    let mut flow = Flow::new(1, &a);
    flow.sends.items.push(0);
    let mut calls = 0;
    until_done(|| {
        flow.send(&sends).unwrap();
        calls += 1;
        flow.sends.done()
    });
    assert!(calls > 1, "one call sent 48 MiB: no WouldBlock met");
    assert!(reader.join().unwrap() == data);
}

/// `n` PEs as threads, every pair through the mesh; each runs `f`.
fn mesh<T: Send>(n: usize, timeout: Duration, f: impl Fn(usize, Mesh) -> T + Sync) -> Vec<T> {
    let listeners: Vec<Listener> = (0..n).map(|_| listen(None).unwrap()).collect();
    let addresses: Vec<String> = listeners.iter().map(|l| l.address.clone()).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let (addresses, f) = (&addresses, &f);
                scope.spawn(move || {
                    let tcp: Vec<bool> = (0..n).map(|q| q != r).collect();
                    f(r, l.connect(r, &tcp, addresses, 42, timeout).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every PE sends every other two segments of its own bytes, larger
/// than a socket buffer, all at once: each arrives intact where its
/// receiver listed it.
#[test]
fn all_to_all_segments_arrive_intact_without_deadlock() {
    let n = 4;
    let bytes = |from: usize, to: usize, k: usize| -> Vec<u8> {
        (0..300_000 + 1000 * k)
            .map(|i| (i * 7 + from * 31 + to * 101 + k) as u8)
            .collect()
    };
    let ok = mesh(n, Duration::from_secs(20), |me, mut m| {
        let src: Vec<Vec<u8>> = (0..n)
            .flat_map(|to| (0..2).map(move |k| (to, k)))
            .map(|(to, k)| bytes(me, to, k))
            .collect();
        let mut dst: Vec<Vec<u8>> = (0..n)
            .flat_map(|from| (0..2).map(move |k| (from, k)))
            .map(|(from, k)| vec![0u8; bytes(from, me, k).len()])
            .collect();
        let sends: Vec<Segment> = (0..n)
            .filter(|&q| q != me)
            .flat_map(|q| (0..2).map(move |k| (q, k)))
            .map(|(q, k)| Segment {
                peer: q,
                address: src[q * 2 + k].as_ptr() as u64,
                bytes: src[q * 2 + k].len(),
            })
            .collect();
        let recvs: Vec<Segment> = (0..n)
            .filter(|&q| q != me)
            .flat_map(|q| (0..2).map(move |k| (q, k)))
            .map(|(q, k)| Segment {
                peer: q,
                address: dst[q * 2 + k].as_mut_ptr() as u64,
                bytes: dst[q * 2 + k].len(),
            })
            .collect();
        // SAFETY: every segment is a live Vec of its length; receives
        // are distinct Vecs.
        unsafe { m.exchange(&sends, &recvs) }.unwrap();
        (0..n)
            .filter(|&q| q != me)
            .all(|q| (0..2).all(|k| dst[q * 2 + k] == bytes(q, me, k)))
    });
    assert_eq!(ok, vec![true; n]);
}

/// A receiver expecting another length, and a peer that closes its
/// connections, fail the exchange by name; the mesh then stays failed.
#[test]
fn a_disagreeing_length_and_a_closed_peer_fail_by_name() {
    let errors = mesh(2, Duration::from_secs(10), |me, mut m| {
        let data = [5u8; 64];
        let mut got = [0u8; 64];
        let (sends, recvs) = match me {
            0 => (
                vec![Segment {
                    peer: 1,
                    address: data.as_ptr() as u64,
                    bytes: 64,
                }],
                vec![],
            ),
            _ => (
                vec![],
                vec![Segment {
                    peer: 0,
                    address: got.as_mut_ptr() as u64,
                    bytes: 32,
                }],
            ),
        };
        // SAFETY: live arrays of at least the listed bytes.
        let r = unsafe { m.exchange(&sends, &recvs) };
        if me == 1 {
            let e = r.unwrap_err();
            // Failed: the next exchange returns the same error.
            // SAFETY: as above.
            assert_eq!(unsafe { m.exchange(&[], &recvs) }.unwrap_err(), e);
            assert!(m.failed().is_some());
            Some(e)
        } else {
            r.unwrap();
            // Rank 1 closed every connection after its failure.
            let recv = [Segment {
                peer: 1,
                address: got.as_mut_ptr() as u64,
                bytes: 8,
            }];
            // SAFETY: as above.
            Some(unsafe { m.exchange(&[], &recv) }.unwrap_err())
        }
    });
    let e1 = errors[1].as_ref().unwrap();
    assert_eq!(e1.status(), xcall_core::Status::CollectiveMismatch, "{e1}");
    assert!(
        e1.to_string()
            .contains("expected a segment of 32 bytes from PE 0, which sent 64"),
        "{e1}"
    );
    let e0 = errors[0].as_ref().unwrap();
    assert_eq!(e0.status(), xcall_core::Status::PeerFailed, "{e0}");
    assert!(
        e0.to_string().contains("rank 0 receiving from PE 1"),
        "{e0}"
    );
}

/// A peer that never connects is a timeout naming it; a stranger's
/// connection and a wrong token are dropped, not admitted.
#[test]
fn strangers_are_dropped_and_a_missing_peer_times_out() {
    let l = listen(None).unwrap();
    let addr = l.address.clone();
    let stranger = std::thread::spawn(move || {
        let mut s = TcpStream::connect(&addr).unwrap();
        let _ = s.write_all(&hello(7, 1)); // wrong token
        let mut t = TcpStream::connect(&addr).unwrap();
        let _ = t.write_all(b"GET / HTTP/1.0\r\n");
    });
    let started = Instant::now();
    let e = l
        .connect(
            0,
            &[false, true],
            &["".into(), "".into()],
            42,
            Duration::from_millis(800),
        )
        .err()
        .expect("a mesh without rank 1 formed");
    stranger.join().unwrap();
    assert_eq!(e.status(), xcall_core::Status::Timeout, "{e}");
    assert!(e.to_string().contains("rank(s) [1]"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let e = listen(None)
        .unwrap()
        .connect(
            1,
            &[true, false],
            &["not an address".into(), "".into()],
            42,
            Duration::from_secs(1),
        )
        .err()
        .unwrap();
    assert_eq!(e.status(), xcall_core::Status::CollectiveMismatch, "{e}");
}

/// Tokens are drawn, not fixed: two worlds' tokens differ.
#[test]
fn tokens_differ_between_worlds() {
    let t: Vec<u64> = (0..4).map(|_| token()).collect();
    assert!(t.windows(2).all(|w| w[0] != w[1]), "{t:?}");
}

/// A dial retries while the lower rank is not listening yet, until
/// the deadline; nobody listening at all is a timeout naming the rank.
#[test]
fn dials_retry_until_the_peer_listens_or_the_deadline() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let address = format!("127.0.0.1:{port}");
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        listener.set_nonblocking(true).unwrap();
        let l = Listener {
            listener,
            address: format!("127.0.0.1:{port}"),
        };
        l.connect(
            0,
            &[false, true],
            &["".into(), "".into()],
            9,
            Duration::from_secs(10),
        )
        .map(|m| m.reaches(1))
    });
    let m = listen(None)
        .unwrap()
        .connect(
            1,
            &[true, false],
            &[address, "".into()],
            9,
            Duration::from_secs(10),
        )
        .unwrap();
    assert!(m.reaches(0) && !m.reaches(1) && !m.reaches(2));
    assert_eq!(late.join().unwrap(), Ok(true));

    let started = Instant::now();
    let e = listen(None)
        .unwrap()
        .connect(
            1,
            &[true, false],
            &[format!("127.0.0.1:{port}"), "".into()],
            9,
            Duration::from_millis(400),
        )
        .err()
        .expect("reached a rank nobody runs");
    assert_eq!(e.status(), xcall_core::Status::Timeout, "{e}");
    assert!(e.to_string().contains("could not reach rank 0"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// A segment naming a PE outside the mesh is refused before anything
/// moves; a receive nothing arrives for is a timeout; a peer whose
/// mesh is dropped is seen at once as gone.
#[test]
fn unknown_peers_silence_and_a_dropped_peer_fail_by_kind() {
    let errors = mesh(3, Duration::from_millis(500), |me, mut m| {
        let mut got = [0u8; 8];
        let seg = |peer: usize, got: &mut [u8; 8]| Segment {
            peer,
            address: got.as_mut_ptr() as u64,
            bytes: 8,
        };
        match me {
            0 => {
                // SAFETY: `got` is 8 writable bytes.
                let bad = unsafe { m.exchange(&[], &[seg(0, &mut got)]) }.unwrap_err();
                // SAFETY: as above.
                // SAFETY: as above.
                let far = unsafe { m.exchange(&[], &[seg(7, &mut got)]) }.unwrap_err();
                // Refused before anything moved: the mesh still works.
                assert!(m.failed().is_none());
                // Rank 1 never sends: a timeout.
                // SAFETY: as above.
                let quiet = unsafe { m.exchange(&[], &[seg(1, &mut got)]) }.unwrap_err();
                vec![bad, far, quiet]
            }
            1 => {
                std::thread::sleep(Duration::from_millis(1500));
                vec![]
            }
            _ => {
                // Rank 0 fails (at 500 ms) and closes its
                // connections: seen then, before this read's timeout.
                std::thread::sleep(Duration::from_millis(250));
                // SAFETY: `got` is 8 writable bytes.
                let gone = unsafe { m.exchange(&[], &[seg(0, &mut got)]) }.unwrap_err();
                drop(m);
                vec![gone]
            }
        }
    });
    let (bad, far, quiet) = (&errors[0][0], &errors[0][1], &errors[0][2]);
    assert_eq!(bad.status(), xcall_core::Status::InvalidArgument, "{bad}");
    assert!(bad.to_string().contains("PE 0 is not a TCP pair"), "{bad}");
    assert_eq!(far.status(), xcall_core::Status::InvalidArgument, "{far}");
    assert_eq!(quiet.status(), xcall_core::Status::Timeout, "{quiet}");
    assert!(quiet.to_string().contains("receiving from PE 1"), "{quiet}");
    let gone = &errors[2][0];
    assert_eq!(gone.status(), xcall_core::Status::PeerFailed, "{gone}");
}

/// Dropping a mesh closes its connections: a peer waiting on it
/// learns at once, long before its timeout.
#[test]
fn a_dropped_mesh_is_seen_at_once() {
    let waited = mesh(2, Duration::from_secs(20), |me, m| {
        let mut m = m;
        if me == 1 {
            std::thread::sleep(Duration::from_millis(200));
            drop(m);
            return None;
        }
        let mut got = [0u8; 8];
        let started = Instant::now();
        let seg = [Segment {
            peer: 1,
            address: got.as_mut_ptr() as u64,
            bytes: 8,
        }];
        // SAFETY: `got` is 8 writable bytes.
        let e = unsafe { m.exchange(&[], &seg) }.unwrap_err();
        Some((e, started.elapsed()))
    });
    let (e, took) = waited[0].clone().unwrap();
    assert_eq!(e.status(), xcall_core::Status::PeerFailed, "{e}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}
