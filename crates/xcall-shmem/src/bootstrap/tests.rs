//! The bootstraps' unit tests.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::star::{read_frame, unpack, write_frame};
use super::unix_socket::same_user;
use super::{abandon, group_alive, Bootstrap, InProcess, Tcp, UnixSocket};
use crate::limits::{MAX_FRAME, MAX_PES};

/// Ranks outside the world and sizes past `MAX_PES` are refused
/// before a group is made (nothing allocated for them); `MAX_PES`
/// itself joins. `abandon` with such a rank makes no group.
#[test]
fn joins_check_rank_and_size_first() {
    let t = Duration::from_secs(5);
    let max = MAX_PES;
    for (rank, size) in [(2, 2), (0, 0), (5, 3), (0, max + 1), (0, usize::MAX)] {
        let e = InProcess::join("check-rank", rank, size, t)
            .err()
            .unwrap_or_else(|| panic!("rank {rank} of {size} joined"));
        assert_eq!(e.status(), xcall_core::Status::InvalidArgument, "{e}");
        abandon("check-rank-abandon", rank, size, t, "bad");
        assert!(!group_alive("check-rank-abandon"), "rank {rank} of {size}");
    }
    assert!(!group_alive("check-rank"));
    let b = InProcess::join("check-rank-max", max - 1, max, t).unwrap();
    assert_eq!((b.rank(), b.size()), (max - 1, max));
    drop(b);
    assert!(!group_alive("check-rank-max"));
}

/// While rank 0 listens, its socket is owner-only; a same-user rank 1
/// is admitted and the collective works.
#[test]
fn the_listening_socket_is_owner_only_and_admits_this_user() {
    let path = std::env::temp_dir().join(format!("xcall-perm-{}.sock", std::process::id()));
    let p0 = path.clone();
    let zero = std::thread::spawn(move || {
        let mut b = UnixSocket::connect(&p0, 0, 2, Duration::from_secs(20)).unwrap();
        b.allgather(b"zero").unwrap()
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let mode = loop {
        // The mode is set right after bind: wait until it shows.
        if let Ok(m) = std::fs::symlink_metadata(&path) {
            let mode = m.permissions().mode() & 0o777;
            if mode == 0o600 || Instant::now() >= deadline {
                break mode;
            }
        }
        assert!(Instant::now() < deadline, "watchdog: rank 0 never listened");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
    let mut one = UnixSocket::connect(&path, 1, 2, Duration::from_secs(20)).unwrap();
    let all = one.allgather(b"one").unwrap();
    assert_eq!(all, vec![b"zero".to_vec(), b"one".to_vec()]);
    assert_eq!(zero.join().unwrap(), all);
    assert!(!path.exists(), "removed once every PE connected");
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Over TCP a connection that is not a rank (silent, or sending
/// anything but the hello) is dropped and the world still forms; a
/// rank of another size fails it by name; a missing rank is named by
/// the timeout; an address that does not resolve is refused.
#[test]
fn tcp_ranks_meet_past_strangers() {
    let address = format!("127.0.0.1:{}", free_port());
    let t = Duration::from_secs(20);
    let ranks: Vec<_> = (0..3)
        .map(|r| {
            let a = address.clone();
            std::thread::spawn(move || {
                if r > 0 {
                    // Rank 0 first, so the strangers below get in first.
                    std::thread::sleep(Duration::from_millis(300));
                }
                let mut b = Tcp::connect(&a, r, 3, t)?;
                b.allgather(format!("rank {r}").as_bytes())
            })
        })
        .collect();
    let deadline = Instant::now() + t;
    let mut strangers = Vec::new();
    while strangers.len() < 2 {
        assert!(Instant::now() < deadline, "watchdog: rank 0 never listened");
        match TcpStream::connect(&address) {
            Ok(mut s) => {
                if strangers.is_empty() {
                    s.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
                }
                strangers.push(s); // the second stays silent
            }
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
    let want: Vec<Vec<u8>> = (0..3).map(|r| format!("rank {r}").into_bytes()).collect();
    for (r, h) in ranks.into_iter().enumerate() {
        assert_eq!(h.join().unwrap().unwrap(), want, "rank {r}");
    }

    let address = format!("127.0.0.1:{}", free_port());
    let a = address.clone();
    let zero = std::thread::spawn(move || Tcp::connect(&a, 0, 2, t).err());
    let e = Tcp::connect(&address, 1, 3, t);
    let e0 = zero.join().unwrap().expect("rank 0 took a rank of 3 PEs");
    assert_eq!(e0.status(), xcall_core::Status::CollectiveMismatch, "{e0}");
    assert!(
        e0.to_string().contains("world of 3 PEs, rank 0 has 2"),
        "{e0}"
    );
    drop(e);

    let started = Instant::now();
    let address = format!("127.0.0.1:{}", free_port());
    let e = Tcp::connect(&address, 0, 2, Duration::from_millis(300))
        .err()
        .expect("a world with a missing rank formed");
    assert_eq!(e.status(), xcall_core::Status::Timeout, "{e}");
    assert!(e.to_string().contains("rank(s) [1]"), "{e}");
    let e = Tcp::connect(&address, 1, 2, Duration::from_millis(300))
        .err()
        .expect("rank 1 connected to nobody");
    assert_eq!(e.status(), xcall_core::Status::Timeout, "{e}");
    assert!(started.elapsed() < Duration::from_secs(10));

    let e = Tcp::connect("no-such-host.invalid:1", 1, 2, t)
        .err()
        .unwrap();
    assert_eq!(e.status(), xcall_core::Status::InvalidArgument, "{e}");
    let e = Tcp::connect("127.0.0.1", 1, 2, t).err().unwrap();
    assert_eq!(e.status(), xcall_core::Status::InvalidArgument, "{e}");
}

#[test]
fn same_user_accepts_this_process() {
    let (a, _b) = UnixStream::pair().unwrap();
    assert_eq!(same_user(&a), Ok(()));
}

/// Rank 0's answer is split into exactly `size` records; a length
/// past the end, a short tail or a wrong count is malformed (never a
/// panic), and empty records count.
#[test]
fn answers_unpack_exactly_or_not_at_all() {
    let pack = |records: &[&[u8]]| {
        let mut p = Vec::new();
        for r in records {
            p.extend((r.len() as u64).to_le_bytes());
            p.extend(*r);
        }
        p
    };
    let good = pack(&[b"ab", b"", b"xyz"]);
    assert_eq!(
        unpack(&good, 3),
        Some(vec![b"ab".to_vec(), vec![], b"xyz".to_vec()])
    );
    assert_eq!(unpack(&good, 2), None);
    assert_eq!(unpack(&good, 4), None);
    assert_eq!(unpack(&good[..good.len() - 1], 3), None);
    assert_eq!(unpack(&good[..5], 1), None);
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_eq!(unpack(&huge, 3), None);
    assert_eq!(unpack(&[], 0), Some(vec![]));
}

/// A frame longer than the room left is refused from its length alone,
/// before its bytes are read or allocated; one that fits is read.
#[test]
fn frames_past_their_room_are_refused_by_length() {
    let (mut a, mut b) = UnixStream::pair().unwrap();
    let by = || Instant::now() + Duration::from_secs(5);
    write_frame(&mut a, b"0123456789").unwrap();
    assert_eq!(read_frame(&mut b, by(), 10).unwrap(), b"0123456789");
    write_frame(&mut a, b"0123456789").unwrap();
    let e = read_frame(&mut b, by(), 9).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
    assert!(e.to_string().contains("10 bytes"), "{e}");
    a.write_all(&u64::MAX.to_le_bytes()).unwrap();
    let e = read_frame(&mut b, by(), MAX_FRAME).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
}
