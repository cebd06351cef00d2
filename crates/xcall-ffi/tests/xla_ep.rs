//! The expert-parallel XLA handlers on Host, driven like XLA drives them:
//! one group opened for every PE at once, then each PE's calls from a
//! thread of its own, with fake call frames; and the refusals of
//! `xcall_xla_ep_open` / `_close` and of frames that do not fit the group.

// The fake frames keep each buffer boxed: XLA holds pointers to them.
#![allow(clippy::vec_box)]

mod xla_fake;

use xcall::xla::abi::*;
use xcall::*;
use xcall_core::testing::{run_threads, watchdog};
use xcall_core::Status;
use xla_fake::*;

const T: usize = 6;
const H: usize = 4;
const K: usize = 2;
const E: usize = 4;

fn config() -> xcall_ep_config {
    xcall_ep_config {
        tokens: T as u64,
        hidden: H as u64,
        topk: K as u64,
        experts: E as u64,
        align: 1,
        capacity: 0,
        precision: EpPrecisionCode(EpPrecision::F32 as u32),
        num_sms: 0,
    }
}

fn open(pes: u64, c: &xcall_ep_config) -> Result<(u64, u64), Status> {
    let (mut id, mut bytes) = (0, 0);
    match xcall_xla_ep_open(0, std::ptr::null(), pes, c, 20_000, &mut id, &mut bytes) {
        Status::Ok => Ok((id, bytes)),
        s => Err(s),
    }
}

#[test]
fn open_and_close_refuse_bad_input_and_make_nothing() {
    let c = config();
    let (mut id, mut bytes) = (7, 7);
    let null = std::ptr::null();
    assert_eq!(
        xcall_xla_ep_open(0, null, 2, std::ptr::null(), 0, &mut id, &mut bytes),
        Status::NullArgument
    );
    let no = std::ptr::null_mut();
    assert_eq!(
        xcall_xla_ep_open(0, null, 2, &c, 0, no, &mut bytes),
        Status::NullArgument
    );
    for n in [0, 65] {
        assert_eq!(open(n, &c), Err(Status::InvalidArgument));
        assert!(
            last_error().contains(&format!("count must be in 1..=64, not {n}")),
            "{}",
            last_error()
        );
    }
    assert_eq!(
        open(3, &c),
        Err(Status::InvalidArgument),
        "4 experts over 3 PEs"
    );
    let wide = xcall_ep_config { topk: 5, ..c };
    assert_eq!(open(2, &wide), Err(Status::InvalidArgument), "k > E");
    assert!(
        last_error().contains("topk 5 is more than the 4 experts"),
        "{}",
        last_error()
    );
    assert_eq!(
        xcall_xla_ep_open(9, null, 2, &c, 0, &mut id, &mut bytes),
        Status::InvalidArgument
    );
    // CUDA needs its ordinals, each once.
    assert_eq!(
        xcall_xla_ep_open(1, null, 2, &c, 0, &mut id, &mut bytes),
        Status::NullArgument
    );
    let twice = [0u32, 0];
    assert_eq!(
        xcall_xla_ep_open(1, twice.as_ptr(), 2, &c, 0, &mut id, &mut bytes),
        Status::InvalidArgument
    );
    assert_eq!((id, bytes), (7, 7), "outputs untouched");
    assert_eq!(xcall_xla_ep_close(u64::MAX), Status::InvalidHandle);

    let (id, bytes) = open(2, &c).unwrap();
    // ids [T, k] i32, sent [P] i32, then 3 * [P, T, k] 4-byte values.
    assert!(bytes as usize >= (T * K + 2 + 3 * 2 * T * K) * 4, "{bytes}");
    assert_eq!(xcall_xla_ep_check(id), Status::Ok);
    let mut dropped = 9;
    assert_eq!(xcall_xla_ep_dropped_routes(id, 1, &mut dropped), Status::Ok);
    assert_eq!(dropped, 0);
    assert_eq!(
        xcall_xla_ep_dropped_routes(id, 2, &mut dropped),
        Status::InvalidArgument
    );
    assert_eq!(xcall_xla_ep_close(id), Status::Ok);
    assert_eq!(xcall_xla_ep_close(id), Status::InvalidHandle, "closed once");
    assert_eq!(xcall_xla_ep_check(id), Status::InvalidHandle);
}

fn last_error() -> String {
    // SAFETY: the thread's last message, NUL-terminated.
    unsafe { std::ffi::CStr::from_ptr(xcall_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// One PE's inputs: token t of PE r is all (r * 10 + t), routed to
/// experts (t % E) and ((t + 1 + r) % E) with probs 0.75 and 0.25.
fn inputs(rank: usize) -> (Vec<f32>, Vec<i32>, Vec<f32>) {
    let x = (0..T * H).map(|i| (rank * 10 + i / H) as f32).collect();
    let mut ids = Vec::new();
    for t in 0..T {
        let a = t % E;
        let mut b = (t + 1 + rank) % E;
        if b == a {
            b = (b + 1) % E;
        }
        ids.extend([a as i32, b as i32]);
    }
    (x, ids, [0.75f32, 0.25].repeat(T))
}

fn scalar(rank: &mut i32) -> Box<xla_fake::Buf> {
    buf(dtype::S32, (rank as *mut i32).cast(), &[])
}

/// Every PE dispatches, doubles its rows, combines, and takes the
/// gradients; then a frame that does not fit the group is refused on
/// every PE with nothing written.
#[test]
fn host_handlers_dispatch_combine_and_backward_on_two_pes() {
    let c = config();
    let (id, bytes) = open(2, &c).unwrap();
    let rows = 2 * T * K; // dropless: P * T * min(k, L) with L = 2
    run_threads("xla ep", 2, watchdog(), move |rank| {
        let api = || fake_api(API_SIZE_DEVICE_ORDINAL_GET);
        let attrs = [
            ("group", Attr::I64(id as i64)),
            ("zero_unused", Attr::Pred(true)),
        ];
        let (mut x, _, mut probs) = inputs(rank);
        let mut r = rank as i32;
        let mut out = vec![f32::NAN; rows * H];
        let mut tpe = vec![-1i64; E / 2];
        let mut routing = vec![0u8; bytes as usize];
        dispatch_into(id, rank, &mut out, &mut tpe, &mut routing).unwrap();
        // Expert l of this PE gets every route of both PEs to it.
        for (l, n) in tpe.iter().enumerate() {
            let e = (rank * E / 2 + l) as i32;
            let want = (0..2)
                .map(|q| inputs(q).1.iter().filter(|i| **i == e).count())
                .sum::<usize>();
            assert_eq!(*n as usize, want, "expert {e}");
        }
        let used = tpe.iter().sum::<i64>() as usize;
        assert!(
            out[used * H..].iter().all(|v| *v == 0.0),
            "unused rows zeroed"
        );

        // Combine of doubled rows: each token comes back as 2 x (probs sum to 1).
        let mut doubled: Vec<f32> = out.iter().map(|v| 2.0 * v).collect();
        let mut y = vec![f32::NAN; T * H];
        let group = [("group", Attr::I64(id as i64))];
        let mut f = frame(
            api(),
            vec![
                buf(dtype::F32, ptr(&mut doubled), &[rows as i64, H as i64]),
                buf(dtype::U8, ptr(&mut routing), &[bytes as i64]),
                scalar(&mut r),
            ],
            vec![buf(dtype::F32, ptr(&mut y), &[T as i64, H as i64])],
            &group,
        );
        call(xcall_xla_ep_combine_host, &mut f).unwrap();
        let want: Vec<f32> = x.iter().map(|v| 2.0 * v).collect();
        assert_eq!(y, want);

        // The gradients: dispatch_backward sums a token's k rows.
        let mut gx = vec![f32::NAN; T * H];
        let mut f = frame(
            api(),
            vec![
                buf(dtype::F32, ptr(&mut out), &[rows as i64, H as i64]),
                buf(dtype::U8, ptr(&mut routing), &[bytes as i64]),
                scalar(&mut r),
            ],
            vec![buf(dtype::F32, ptr(&mut gx), &[T as i64, H as i64])],
            &group,
        );
        call(xcall_xla_ep_dispatch_backward_host, &mut f).unwrap();
        assert_eq!(gx, x.iter().map(|v| 2.0 * v).collect::<Vec<_>>());
        // combine_backward: rows get grad_y times the prob, the probs
        // their rows' dot products; unused rows are zero.
        let mut gy = vec![1.0f32; T * H];
        let mut geo = vec![f32::NAN; rows * H];
        let mut gp = vec![f32::NAN; T * K];
        let mut f = frame(
            api(),
            vec![
                buf(dtype::F32, ptr(&mut gy), &[T as i64, H as i64]),
                buf(dtype::F32, ptr(&mut doubled), &[rows as i64, H as i64]),
                buf(dtype::U8, ptr(&mut routing), &[bytes as i64]),
                scalar(&mut r),
            ],
            vec![
                buf(dtype::F32, ptr(&mut geo), &[rows as i64, H as i64]),
                buf(dtype::F32, ptr(&mut gp), &[T as i64, K as i64]),
            ],
            &group,
        );
        call(xcall_xla_ep_combine_backward_host, &mut f).unwrap();
        for t in 0..T {
            let dot = 2.0 * H as f32 * x[t * H];
            assert_eq!(&gp[t * K..t * K + K], &[dot, dot], "token {t}");
        }
        assert!(geo[..used * H].iter().all(|v| *v == 0.75 || *v == 0.25));
        assert!(geo[used * H..].iter().all(|v| *v == 0.0));

        // A frame that does not fit the group: refused, nothing written
        // (the rows keep their NaN even with zero_unused).
        let mut short = vec![0i32; (T - 1) * K];
        let mut rows_out = vec![f32::NAN; rows * H];
        let mut f = frame(
            api(),
            vec![
                buf(dtype::F32, ptr(&mut x), &[T as i64, H as i64]),
                buf(dtype::S32, ptr(&mut short), &[(T - 1) as i64, K as i64]),
                buf(dtype::F32, ptr(&mut probs), &[T as i64, K as i64]),
                scalar(&mut r),
            ],
            vec![
                buf(dtype::F32, ptr(&mut rows_out), &[rows as i64, H as i64]),
                buf(dtype::S64, ptr(&mut tpe), &[(E / 2) as i64]),
                buf(dtype::U8, ptr(&mut routing), &[bytes as i64]),
            ],
            &attrs,
        );
        let (code, message) = call(xcall_xla_ep_dispatch_host, &mut f).unwrap_err();
        assert_eq!(code, 3, "INVALID_ARGUMENT");
        assert!(
            message.starts_with("xcall_ep_dispatch: ids is I32 [5, 2]"),
            "{message}"
        );
        assert!(rows_out.iter().all(|v| v.is_nan()), "nothing written");
        // A rank outside the group.
        let mut bad = 2;
        let mut f = frame(
            api(),
            vec![
                buf(dtype::F32, ptr(&mut doubled), &[rows as i64, H as i64]),
                buf(dtype::U8, ptr(&mut routing), &[bytes as i64]),
                scalar(&mut bad),
            ],
            vec![buf(dtype::F32, ptr(&mut y), &[T as i64, H as i64])],
            &group,
        );
        let (_, message) = call(xcall_xla_ep_combine_host, &mut f).unwrap_err();
        assert!(message.contains("operand rank is 2; group"), "{message}");
    });
    assert_eq!(xcall_xla_ep_close(id), Status::Ok);
    // A closed group's handlers say so.
    let mut r = 0;
    let mut y = vec![0f32; T * H];
    let mut eo = vec![0f32; 2 * T * K * H];
    let mut routing = vec![0u8; bytes as usize];
    let mut f = frame(
        fake_api(API_SIZE_DEVICE_ORDINAL_GET),
        vec![
            buf(dtype::F32, ptr(&mut eo), &[(2 * T * K) as i64, H as i64]),
            buf(dtype::U8, ptr(&mut routing), &[bytes as i64]),
            scalar(&mut r),
        ],
        vec![buf(dtype::F32, ptr(&mut y), &[T as i64, H as i64])],
        &[("group", Attr::I64(id as i64))],
    );
    let (_, message) = call(xcall_xla_ep_combine_host, &mut f).unwrap_err();
    assert!(
        message.contains("no open expert-parallel group"),
        "{message}"
    );
}

/// One PE's dispatch through the Host handler (its own inputs).
fn dispatch_pe(id: u64, bytes: u64, rank: usize) -> Result<(), (u32, String)> {
    let mut out = vec![0f32; 2 * T * K * H];
    let mut tpe = vec![0i64; E / 2];
    let mut routing = vec![0u8; bytes as usize];
    dispatch_into(id, rank, &mut out, &mut tpe, &mut routing)
}

/// PE `rank`'s dispatch of its own inputs through the Host handler into
/// `out` (`[2 T K, H]`, the dropless rows), `tpe` and `routing`.
fn dispatch_into(
    id: u64,
    rank: usize,
    out: &mut [f32],
    tpe: &mut [i64],
    routing: &mut [u8],
) -> Result<(), (u32, String)> {
    let (mut x, mut ids, mut probs) = inputs(rank);
    let mut r = rank as i32;
    let mut f = frame(
        fake_api(API_SIZE_DEVICE_ORDINAL_GET),
        vec![
            buf(dtype::F32, ptr(&mut x), &[T as i64, H as i64]),
            buf(dtype::S32, ptr(&mut ids), &[T as i64, K as i64]),
            buf(dtype::F32, ptr(&mut probs), &[T as i64, K as i64]),
            scalar(&mut r),
        ],
        vec![
            buf(dtype::F32, ptr(out), &[(out.len() / H) as i64, H as i64]),
            buf(dtype::S64, ptr(tpe), &[tpe.len() as i64]),
            buf(dtype::U8, ptr(routing), &[routing.len() as i64]),
        ],
        &[
            ("group", Attr::I64(id as i64)),
            ("zero_unused", Attr::Pred(true)),
        ],
    );
    call(xcall_xla_ep_dispatch_host, &mut f).map(|_| ())
}

/// While a PE's call waits for its peer, nothing waits for that PE: a
/// check of the group and a close say Busy at once (the close leaves the
/// group open); once the peer calls, both calls finish, and the group
/// closes.
#[test]
fn a_pe_in_a_call_makes_others_busy_not_wait() {
    let c = config();
    let (id, bytes) = open(2, &c).unwrap();
    let first = std::thread::spawn(move || dispatch_pe(id, bytes, 0));
    // PE 0 is in its call once a check finds it busy.
    let started = std::time::Instant::now();
    loop {
        match xcall_xla_ep_check(id) {
            Status::Busy => break,
            Status::Ok => {}
            s => panic!("check: {s:?}"),
        }
        assert!(
            started.elapsed() < watchdog(),
            "PE 0 never seen in its call"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let asked = std::time::Instant::now();
    assert_eq!(xcall_xla_ep_close(id), Status::Busy, "{}", last_error());
    assert!(
        asked.elapsed() < std::time::Duration::from_secs(5),
        "close waited {:?} for a PE in a call",
        asked.elapsed()
    );
    let second = run_threads("the peer's dispatch", 1, watchdog(), move |_| {
        dispatch_pe(id, bytes, 1)
    });
    assert_eq!(second[0], Ok(()));
    assert_eq!(first.join().unwrap(), Ok(()));
    assert_eq!(xcall_xla_ep_close(id), Status::Ok, "{}", last_error());
}

fn socket_path(what: &str) -> std::ffi::CString {
    let p = std::env::temp_dir().join(format!("xcall-xla-ep-{what}-{}.sock", std::process::id()));
    std::ffi::CString::new(p.to_str().unwrap()).unwrap()
}

/// `ranks` of a group of `size` opened here, meeting at `socket`.
fn open_ranks(
    ranks: &[u64],
    size: u64,
    socket: *const std::ffi::c_char,
    c: &xcall_ep_config,
) -> Result<(u64, u64), Status> {
    let (mut id, mut bytes) = (0, 0);
    let n = ranks.len() as u64;
    match xcall_xla_ep_open_ranks(
        0,
        std::ptr::null(),
        ranks.as_ptr(),
        n,
        size,
        socket,
        c,
        20_000,
        &mut id,
        &mut bytes,
    ) {
        Status::Ok => Ok((id, bytes)),
        s => Err(s),
    }
}

#[test]
fn open_ranks_refuses_bad_input_and_makes_nothing() {
    let c = config();
    let s = socket_path("bad");
    let (mut id, mut bytes) = (7, 7);
    let null_ranks = xcall_xla_ep_open_ranks(
        0,
        std::ptr::null(),
        std::ptr::null(),
        1,
        2,
        s.as_ptr(),
        &c,
        0,
        &mut id,
        &mut bytes,
    );
    assert_eq!(null_ranks, Status::NullArgument);
    assert_eq!(
        open_ranks(&[0], 2, std::ptr::null(), &c),
        Err(Status::NullArgument)
    );
    for (ranks, size, want) in [
        (&[0u64][..], 0, "size must be in 1..=64"),
        (&[0], 65, "size must be in 1..=64"),
        (&[0, 1, 2], 2, "count must be in 1..=2"),
        (&[], 2, "count must be in 1..=2"),
        (&[0, 0], 2, "rank 0 is listed twice"),
        (&[2], 2, "ranks[0] is 2; the group's ranks are 0..2"),
    ] {
        assert_eq!(
            open_ranks(ranks, size, s.as_ptr(), &c),
            Err(Status::InvalidArgument),
            "{ranks:?} of {size}"
        );
        assert!(last_error().contains(want), "{}", last_error());
    }
    let long = std::ffi::CString::new("/tmp/".to_string() + &"x".repeat(103)).unwrap();
    let empty = std::ffi::CString::new("").unwrap();
    let latin = std::ffi::CString::new(vec![b'/', 0xff]).unwrap();
    for (path, want) in [
        (&long, "1..=107 bytes, not 108"),
        (&empty, "not 0 bytes"),
        (&latin, "not UTF-8"),
    ] {
        assert_eq!(
            open_ranks(&[0], 2, path.as_ptr(), &c),
            Err(Status::InvalidArgument)
        );
        assert!(last_error().contains(want), "{}", last_error());
    }
    let wide = xcall_ep_config { topk: 5, ..c };
    assert_eq!(
        open_ranks(&[0], 2, s.as_ptr(), &wide),
        Err(Status::InvalidArgument),
        "k > E"
    );
    assert_eq!((id, bytes), (7, 7), "outputs untouched");
}

/// A group of two PEs opened in two parts (one rank each, as two processes
/// do) meeting at a Unix socket: each part's dispatch writes what the
/// group opened at once writes, and each part knows only its own rank.
#[test]
fn a_group_opened_rank_by_rank_dispatches_as_one_opened_at_once() {
    let c = config();
    let rows = 2 * T * K;
    let (whole, bytes) = open(2, &c).unwrap();
    let want = run_threads("whole group", 2, watchdog(), move |rank| {
        let mut out = vec![f32::NAN; rows * H];
        let mut tpe = vec![-1i64; E / 2];
        let mut routing = vec![0u8; bytes as usize];
        dispatch_into(whole, rank, &mut out, &mut tpe, &mut routing).unwrap();
        (out, tpe)
    });
    assert_eq!(xcall_xla_ep_close(whole), Status::Ok);
    let s = socket_path("parts");
    let path = s.to_str().unwrap().to_string();
    let got = run_threads("group in parts", 2, watchdog(), move |rank| {
        let s = std::ffi::CString::new(path.clone()).unwrap();
        let (id, part_bytes) = open_ranks(&[rank as u64], 2, s.as_ptr(), &c).unwrap();
        assert_eq!(part_bytes, bytes);
        let mut out = vec![f32::NAN; rows * H];
        let mut tpe = vec![-1i64; E / 2];
        let mut routing = vec![0u8; bytes as usize];
        dispatch_into(id, rank, &mut out, &mut tpe, &mut routing).unwrap();
        // The other rank is not this part's.
        let mut dropped = 0;
        assert_eq!(
            xcall_xla_ep_dropped_routes(id, 1 - rank as u64, &mut dropped),
            Status::InvalidArgument
        );
        assert!(
            last_error().contains("not a PE of group"),
            "{}",
            last_error()
        );
        assert_eq!(
            xcall_xla_ep_dropped_routes(id, rank as u64, &mut dropped),
            Status::Ok
        );
        let other = dispatch_into(
            id,
            1 - rank,
            &mut out.clone(),
            &mut tpe.clone(),
            &mut routing,
        );
        let (_, message) = other.unwrap_err();
        assert!(
            message.contains(&format!("of them [{rank}] in this process")),
            "{message}"
        );
        assert_eq!(xcall_xla_ep_close(id), Status::Ok, "{}", last_error());
        (out, tpe)
    });
    assert_eq!(got, want);
}
