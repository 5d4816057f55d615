"""The pipeline section of the training report (``harness.report.pipeline_report``): the timeline picture,
the measured bubble by hand, the simulated bubble on the schedule that ran, and the convergence report
gaining the section for PP > 1 only.

``ROW`` / ``TIMELINE``: the metrics row of step 0 (layout dcp) of ``TrainConfig(pp=2, vpp=2)`` on 8 gloo
ranks (times rounded to microseconds); ``cp_sizes`` are those of step 0's schedule for the pipeline execution
model, which the report re-plans."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from harness.plan import Block, CostModel, Execution, Schedule, simulate
from harness.report import pipeline_report as pr

ROW = {"layout": "dcp", "step": 0, "loss": 5.55847851834815, "aux_loss": 0.0, "grad_norm": 0.7146323498263647, "tokens": 4337, "processed_tokens": 4346, "padding_fraction": 0.002070869765301464, "step_time": 0.3334575019998738, "tokens_per_s": 13006.155129182374, "microbatches": 6, "cp_histogram": {"1": 26, "2": 6}}
TIMELINE = [json.loads(s) for s in (
    '{"rank":0,"stage":0,"position":0,"chunks":[[],[1]],"cp_sizes":[4,4,4,2,2,1],"events":[["F",0,0,3e-06,4e-06,0.003937],["F",1,0,0.00394,0.003941,0.005154],["F",0,1,0.005156,0.031769,0.053493],["F",1,1,0.053495,0.055232,0.061074],["F",2,0,0.061077,0.061078,0.061749],["B",0,1,0.06175,0.063109,0.086018],["F",3,0,0.08602,0.086021,0.086658],["B",1,1,0.086663,0.093287,0.1048],["F",2,1,0.104802,0.104937,0.111024],["B",0,0,0.111025,0.112587,0.11281],["F",3,1,0.112811,0.118862,0.123458],["B",1,0,0.12346,0.126339,0.126523],["F",4,0,0.126524,0.126525,0.12705],["B",2,1,0.127051,0.128938,0.136039],["F",5,0,0.136041,0.136041,0.136509],["B",3,1,0.13651,0.142832,0.153386],["F",4,1,0.153389,0.154112,0.161038],["B",2,0,0.16104,0.16142,0.162924],["F",5,1,0.162925,0.163791,0.165266],["B",3,0,0.165267,0.166757,0.16692],["B",4,1,0.166921,0.170012,0.174986],["B",5,1,0.174988,0.181554,0.185335],["B",4,0,0.185336,0.186093,0.18626],["B",5,0,0.186262,0.194578,0.194774]]}',
    '{"rank":1,"stage":0,"position":1,"chunks":[[],[1]],"cp_sizes":[4,4,4,2,2,1],"events":[["F",0,0,3e-06,4e-06,0.001727],["F",1,0,0.00173,0.001731,0.002382],["F",0,1,0.002383,0.025571,0.047264],["F",1,1,0.047315,0.051481,0.062151],["F",2,0,0.062155,0.062156,0.067599],["B",0,1,0.067601,0.073076,0.085681],["F",3,0,0.085684,0.085686,0.087219],["B",1,1,0.087226,0.092822,0.099007],["F",2,1,0.099009,0.100083,0.105801],["B",0,0,0.105804,0.105949,0.106197],["F",3,1,0.106199,0.112967,0.123028],["B",1,0,0.123031,0.125987,0.126204],["F",4,0,0.126206,0.126207,0.126724],["B",2,1,0.126725,0.129408,0.137728],["F",5,0,0.13773,0.137731,0.142701],["B",3,1,0.142703,0.143053,0.149777],["F",4,1,0.149779,0.151817,0.159811],["B",2,0,0.159813,0.164431,0.164692],["F",5,1,0.164694,0.169599,0.173588],["B",3,0,0.173591,0.188743,0.189073],["B",4,1,0.189075,0.195706,0.198898],["B",5,1,0.1989,0.201013,0.202649],["B",4,0,0.202651,0.205066,0.205253],["B",5,0,0.205255,0.207768,0.207895]]}',
    '{"rank":2,"stage":0,"position":2,"chunks":[[],[1]],"cp_sizes":[4,4,4,2,1,1],"events":[["F",0,0,3e-06,3e-06,0.003835],["F",1,0,0.003838,0.003839,0.008178],["F",0,1,0.008181,0.019465,0.026214],["F",1,1,0.026217,0.031357,0.046242],["F",2,0,0.046245,0.046245,0.054051],["B",0,1,0.054054,0.0553,0.071718],["F",3,0,0.071722,0.071723,0.072401],["B",1,1,0.072406,0.073646,0.080475],["F",2,1,0.080477,0.085241,0.095372],["B",0,0,0.095373,0.098483,0.098742],["F",3,1,0.098745,0.098875,0.103546],["B",1,0,0.103548,0.113142,0.113382],["F",4,0,0.113385,0.113386,0.117517],["B",2,1,0.117518,0.121854,0.131651],["F",5,0,0.131653,0.131654,0.134249],["B",3,1,0.13425,0.141115,0.152359],["F",4,1,0.152363,0.156958,0.158659],["B",2,0,0.158661,0.163605,0.163878],["F",5,1,0.16388,0.168676,0.174114],["B",3,0,0.174116,0.182627,0.182849],["B",4,1,0.182852,0.182966,0.192058],["B",5,1,0.192062,0.195465,0.197011],["B",4,0,0.197013,0.197092,0.197256],["B",5,0,0.197257,0.19965,0.199776]]}',
    '{"rank":3,"stage":0,"position":3,"chunks":[[],[1]],"cp_sizes":[4,4,4,2,1,1],"events":[["F",0,0,3e-06,4e-06,0.000938],["F",1,0,0.00094,0.00094,0.001348],["F",0,1,0.001349,0.013448,0.033073],["F",1,1,0.033077,0.033291,0.041796],["F",2,0,0.041799,0.0418,0.042528],["B",0,1,0.042529,0.04645,0.067153],["F",3,0,0.067157,0.067159,0.06773],["B",1,1,0.067736,0.06917,0.076347],["F",2,1,0.076349,0.080887,0.10269],["B",0,0,0.102693,0.109867,0.110164],["F",3,1,0.110166,0.110401,0.113554],["B",1,0,0.113556,0.118958,0.119241],["F",4,0,0.119243,0.119244,0.119852],["B",2,1,0.119853,0.123862,0.131496],["F",5,0,0.131499,0.1315,0.132857],["B",3,1,0.132858,0.137186,0.13947],["F",4,1,0.139472,0.146685,0.14837],["B",2,0,0.148372,0.149952,0.151536],["F",5,1,0.151538,0.153684,0.158122],["B",3,0,0.158124,0.162181,0.162441],["B",4,1,0.162443,0.170455,0.178665],["B",5,1,0.178669,0.178838,0.179823],["B",4,0,0.179825,0.185149,0.185357],["B",5,0,0.185359,0.188359,0.188548]]}',
    '{"rank":4,"stage":1,"position":0,"chunks":[[0],[]],"cp_sizes":[4,4,4,2,2,1],"events":[["F",0,0,3e-06,0.006143,0.030883],["F",1,0,0.030887,0.033207,0.042579],["F",0,1,0.042582,0.054411,0.055104],["B",0,1,0.055107,0.055111,0.055949],["F",1,1,0.055952,0.062633,0.063113],["B",1,1,0.063115,0.063116,0.063717],["F",2,0,0.063718,0.066693,0.082711],["B",0,0,0.082718,0.087572,0.107659],["F",3,0,0.107661,0.109543,0.116546],["B",1,0,0.116548,0.118097,0.125293],["F",2,1,0.125294,0.126483,0.126788],["B",2,1,0.126789,0.126791,0.127084],["F",3,1,0.127085,0.128979,0.129352],["B",3,1,0.129353,0.129355,0.131822],["F",4,0,0.131823,0.132447,0.141352],["B",2,0,0.141353,0.152291,0.154664],["F",5,0,0.154666,0.15833,0.160096],["B",3,0,0.160098,0.161905,0.16746],["F",4,1,0.167463,0.167804,0.168202],["B",4,1,0.168203,0.168205,0.170763],["F",5,1,0.170764,0.177283,0.17777],["B",5,1,0.177772,0.177774,0.182269],["B",4,0,0.18227,0.183755,0.185591],["B",5,0,0.185592,0.188722,0.192454]]}',
    '{"rank":5,"stage":1,"position":1,"chunks":[[0],[]],"cp_sizes":[4,4,4,2,2,1],"events":[["F",0,0,3e-06,0.00836,0.031749],["F",1,0,0.031752,0.031889,0.048141],["F",0,1,0.048144,0.050067,0.050729],["B",0,1,0.050731,0.050735,0.055989],["F",1,1,0.055992,0.065626,0.06614],["B",1,1,0.066143,0.066146,0.070922],["F",2,0,0.070925,0.077718,0.083952],["B",0,0,0.083957,0.09203,0.108025],["F",3,0,0.108027,0.108995,0.117564],["B",1,0,0.117566,0.117729,0.126959],["F",2,1,0.126961,0.131798,0.132136],["B",2,1,0.132137,0.132139,0.132575],["F",3,1,0.132576,0.135392,0.135812],["B",3,1,0.135813,0.135815,0.13651],["F",4,0,0.136511,0.138551,0.140317],["B",2,0,0.140318,0.148596,0.155212],["F",5,0,0.155213,0.156432,0.16518],["B",3,0,0.165182,0.169563,0.181649],["F",4,1,0.181651,0.188653,0.189195],["B",4,1,0.189197,0.189199,0.191878],["F",5,1,0.19188,0.193781,0.194211],["B",5,1,0.194212,0.194214,0.198692],["B",4,0,0.198693,0.205746,0.209667],["B",5,0,0.20967,0.210135,0.212191]]}',
    '{"rank":6,"stage":1,"position":2,"chunks":[[0],[]],"cp_sizes":[4,4,4,2,1,1],"events":[["F",0,0,2e-06,0.00284,0.018597],["F",1,0,0.0186,0.018739,0.032176],["F",0,1,0.03218,0.033175,0.035022],["B",0,1,0.035025,0.035028,0.035879],["F",1,1,0.035883,0.048939,0.050015],["B",1,1,0.050018,0.05002,0.050629],["F",2,0,0.050631,0.057738,0.064706],["B",0,0,0.064718,0.074359,0.085595],["F",3,0,0.085598,0.087476,0.09468],["B",1,0,0.094683,0.099072,0.1155],["F",2,1,0.115503,0.117193,0.120804],["B",2,1,0.120806,0.120808,0.121261],["F",3,1,0.121263,0.122697,0.123088],["B",3,1,0.123089,0.123091,0.127685],["F",4,0,0.127688,0.12783,0.140196],["B",2,0,0.140198,0.142585,0.150004],["F",5,0,0.150006,0.161583,0.168828],["B",3,0,0.168831,0.175983,0.181396],["F",4,1,0.181399,0.181535,0.181983],["B",4,1,0.181984,0.181986,0.182437],["F",5,1,0.182438,0.182518,0.182699],["B",5,1,0.1827,0.182701,0.182947],["B",4,0,0.182947,0.188002,0.196881],["B",5,0,0.196885,0.199067,0.201407]]}',
    '{"rank":7,"stage":1,"position":3,"chunks":[[0],[]],"cp_sizes":[4,4,4,2,1,1],"events":[["F",0,0,3e-06,0.003288,0.015703],["F",1,0,0.015706,0.016505,0.025833],["F",0,1,0.025835,0.037172,0.037894],["B",0,1,0.037897,0.0379,0.042105],["F",1,1,0.042111,0.042968,0.043458],["B",1,1,0.04346,0.043462,0.047239],["F",2,0,0.047241,0.047363,0.064044],["B",0,0,0.064052,0.068844,0.084707],["F",3,0,0.08471,0.089655,0.104892],["B",1,0,0.104897,0.10831,0.114137],["F",2,1,0.114139,0.115964,0.118912],["B",2,1,0.118914,0.118916,0.11938],["F",3,1,0.119381,0.121384,0.121807],["B",3,1,0.121809,0.12181,0.126164],["F",4,0,0.126165,0.127666,0.137134],["B",2,0,0.137136,0.138052,0.148832],["F",5,0,0.148834,0.150545,0.155691],["B",3,0,0.155693,0.156668,0.16322],["F",4,1,0.163223,0.16793,0.169177],["B",4,1,0.169178,0.16918,0.169748],["F",5,1,0.169749,0.17277,0.173099],["B",5,1,0.1731,0.173102,0.17344],["B",4,0,0.173441,0.182923,0.187256],["B",5,0,0.187259,0.188306,0.189223]]}',
)]

PP_CONFIG = {"pp": 2, "vpp": 2, "pipeline": "1f1b"}


EXAMPLE_BLOCKS = ((4,), (4,), (4,), (2, 2), (2, 1, 1), (1, 1, 1, 1))


def _example_schedule(blocks=EXAMPLE_BLOCKS) -> Schedule:
    """A schedule with the example's block sizes (per micro-batch, left to right) on 4 positions (one
    sequence per block)."""
    layout, gid, lengths = [], 0, []
    for sizes in blocks:
        mb, start = [], 0
        for size in sizes:
            mb.append(Block(start, size, (gid,)))
            lengths.append((gid, 100 + 37 * gid))
            gid, start = gid + 1, start + size
        layout.append(mb)
    return Schedule.from_blocks(layout, lengths=lengths, n_ranks=4, max_seqlen_per_rank=512)


def test_the_picture_of_the_example_row_is_an_embedded_png():
    html = pr.timeline_png(TIMELINE, layout="dcp", config=PP_CONFIG)
    assert html.startswith("<img") and 'src="data:image/png;base64,' in html
    png = base64.b64decode(html.split("base64,", 1)[1].split('"', 1)[0])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_measured_bubble_of_a_hand_made_timeline():
    """Rank 0 computes 2 + 3 ms, rank 1 2 + 2 ms; the last pass ends at 8 ms: 1 - 9 / (2 x 8) = 7/16."""
    timeline = [
        {"rank": 0, "stage": 0, "position": 0, "chunks": [[0]], "cp_sizes": [1],
         "events": [["F", 0, 0, 0.0, 0.0, 0.002], ["B", 0, 0, 0.004, 0.005, 0.008]]},
        {"rank": 1, "stage": 1, "position": 0, "chunks": [[1]], "cp_sizes": [1],
         "events": [["F", 0, 0, 0.0, 0.002, 0.004], ["B", 0, 0, 0.004, 0.004, 0.006]]},
    ]
    assert pr.compute_time(timeline) == pytest.approx(0.009)
    assert pr.span(timeline) == 0.008
    assert pr.measured_bubble(timeline) == pytest.approx(7 / 16)
    assert pr.measured_bubble([]) == 0.0


def test_the_example_row_bubble_and_micro_batches():
    compute = sum(e[5] - e[4] for r in TIMELINE for e in r["events"])
    assert pr.num_microbatches(TIMELINE) == ROW["microbatches"] == 6
    assert pr.measured_bubble(TIMELINE) == pytest.approx(1 - compute / (8 * pr.span(TIMELINE)))
    assert 0.0 < pr.measured_bubble(TIMELINE) < 1.0


def test_simulated_bubble_uses_the_schedule_that_ran_or_none():
    cost = CostModel(quadratic=1.0, linear=50.0, name="test")
    s = _example_schedule()
    want = simulate(s, cost, Execution.pipeline(2, vpp=2)).bubble_fraction
    assert pr.matches(s, TIMELINE)
    assert pr.simulated_bubble(s, TIMELINE, PP_CONFIG, cost) == pytest.approx(want)
    other = _example_schedule(((4,), (4,), (4,), (2, 2), (1, 1, 1, 1), (1, 1, 1, 1)))
    assert not pr.matches(other, TIMELINE) and pr.simulated_bubble(other, TIMELINE, PP_CONFIG, cost) is None
    rows = {"dcp": [dict(ROW, timeline=TIMELINE)], "thd": [dict(ROW, layout="thd", timeline=TIMELINE)]}
    table = pr.bubble_rows(rows, PP_CONFIG, {"dcp": s, "thd": other}, cost)
    assert table[0][:4] == ["dcp", 6, f"{pr.measured_bubble(TIMELINE):.1%}", f"{want:.1%}"]
    assert table[1][3] == "n/a"


def test_the_runtime_schedule_kind_follows_vpp():
    assert pr.execution_of({"pp": 2, "vpp": 2, "pipeline": "afab"}).pipeline_kind == "interleaved"
    assert pr.execution_of({"pp": 4, "pipeline": "afab"}).pipeline_kind == "afab"
    assert pr.section({"dcp": [dict(ROW, timeline=TIMELINE)]}, {"pp": 1}) == ""
    assert pr.section({"dcp": [ROW]}, PP_CONFIG) == "" and pr.markdown({"dcp": [ROW]}, PP_CONFIG) == ""


def _result(pp: int, vpp: int, rows: dict):
    from harness.apps.converge import ConvergeResult
    from harness.train.layouts import static_cp_for
    from harness.train.trainer import TrainConfig, longest_sequence

    cfg = TrainConfig(pp=pp, vpp=vpp, steps=1)
    world = 4 * pp
    config = {**cfg.to_dict(), "world": world, "static_cp": static_cp_for(longest_sequence(cfg), world // pp,
                                                                          cfg.max_seqlen_per_rank),
              "longest": longest_sequence(cfg), "case_id": "example", "hardware": "cpu", "golden": None}
    from harness.apps.converge import step0_schedules
    from harness.train.config import model_cost

    return ConvergeResult("PASS", Path("."), "example", rows, [], config, schedules=step0_schedules(config),
                          cost=model_cost(cfg))


def test_the_convergence_report_has_the_section_for_pp_runs_only():
    from harness.report.convergence_report import render_standalone

    html, md = render_standalone(_result(2, 2, {"dcp": [dict(ROW, timeline=TIMELINE)]}), None)
    assert "Pipeline: one step per layout (pipeline pp 2 x vpp 2, interleaved)" in html
    assert "measured bubble" in html and "simulated bubble" in html
    section = html.split("Pipeline: one step per layout", 1)[1]
    assert section.count("<img") == 1 and "<td>n/a</td>" not in section  # re-planned step 0 = what ran
    assert "### Pipeline (pipeline pp 2 x vpp 2, interleaved)" in md and f"{pr.measured_bubble(TIMELINE):.1%}" in md

    html1, md1 = render_standalone(_result(1, 1, {"dcp": [ROW]}), None)
    assert "Pipeline" not in html1 and "bubble" not in html1 and "Pipeline" not in md1


def test_rows_without_a_timeline_are_skipped():
    rows = {"bshd": [ROW], "dcp": [ROW, dict(ROW, step=1, timeline=TIMELINE)]}
    assert list(pr.first_timelines(rows)) == ["dcp"]
    assert json.dumps(pr.bubble_rows(rows, PP_CONFIG))  # plain values: the main job may store them
