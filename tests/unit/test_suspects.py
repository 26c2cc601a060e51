"""rein.worker.suspects without services: the split of an engine death's suspects in halves, the
verdict, the roster of who was in an engine when it died, and the gate of who shares it."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import support

from rein.jobs.claim import Lease
from rein.worker.suspects import EngineDeath, EngineRoster, SuspectGate, Suspicion, split_suspects


def lease(job_id: str, group: str | None = None, size: int | None = None, deaths_seen: int = 0) -> Lease:
    return Lease(job_id, 1, "w", "t", "k", "m", "/v1/completions", 3, deaths_seen=deaths_seen,
                 suspect_group=group, suspect_group_size=size)


@dataclass
class Output:
    request_id: str
    finished: bool


def test_a_death_splits_each_prior_group_and_the_fresh_jobs_in_halves():
    present = {f"a{i}": "g" for i in range(5)} | {f"f{i}": None for i in range(2)} | {"h0": "h"}
    split = split_suspects("d", present)
    assert set(split) == set(present)
    halves: dict[str, set[str]] = {}
    for job_id, suspicion in split.items():
        halves.setdefault(suspicion.group, set()).add(job_id)
        assert suspicion.size == sum(s.group == suspicion.group for s in split.values())
    # Group g's five: 3 and 2; the fresh two: 1 and 1; h's one: alone. No half mixes parts.
    assert sorted(map(len, halves.values())) == [1, 1, 1, 2, 3]
    assert all(len({present[job_id] for job_id in members}) == 1 for members in halves.values())
    assert split["h0"] == Suspicion(split["h0"].group, 1)
    assert split_suspects("d", present) == split            # the same record, the same split
    assert not set(s.group for s in split.values()) & set(s.group for s in split_suspects("e", present).values())


def test_a_poison_job_among_64_is_isolated_in_log2_deaths():
    """Dying with whatever half it is in, the poison job's group halves at each death."""
    poison, group, deaths = "j17", None, 0
    members = [f"j{i:02d}" for i in range(64)]
    while True:
        present = {job_id: group for job_id in members}
        death = EngineDeath(f"d{deaths}", present)
        deaths += 1
        if death.isolates(lease(poison, group, len(members), deaths_seen=deaths - 1)):
            break
        suspicion = death.suspicion_of(poison)
        group = suspicion.group
        members = [job_id for job_id, s in death.suspicions.items() if s.group == group]
        assert len(members) == suspicion.size
    assert deaths == 7          # 64 -> 32 -> 16 -> 8 -> 4 -> 2 -> 1, which then dies alone


def test_only_dying_alone_after_an_earlier_death_isolates_a_job():
    alone = EngineDeath("d", {"j": None})
    assert not alone.isolates(lease("j"))                               # one crash alone: a suspect of one
    assert alone.suspicion_of("j").size == 1
    assert alone.isolates(lease("j", "g", 1, deaths_seen=1))
    assert not EngineDeath("d", {"j": "g", "k": None}).isolates(lease("j", "g", 1, deaths_seen=3))


def test_the_roster_counts_present_the_jobs_in_the_engine_when_it_died():
    roster, runner, other = EngineRoster(), object(), object()
    done, dying, later = lease("done"), lease("dying", "g", 2, 1), lease("later")
    with roster.aboard(runner, done), roster.aboard(runner, dying), roster.aboard(other, lease("elsewhere")):
        roster.step([Output("done", True), Output("dying", False)])   # done ended in the engine's last step
        death = roster.death(runner)
        assert death.present == {"dying": "g"}
        with roster.aboard(runner, later):                           # came after the death: not counted
            assert roster.death(runner) is death
    assert roster._boardings == {}


def test_the_gate_runs_one_suspect_group_beside_the_others_and_a_group_of_one_alone():
    gate, events, lock = SuspectGate(), [], threading.Lock()
    release = {name: threading.Event() for name in ("fresh", "g1", "g2", "h", "solo", "late")}

    def run(name: str, group: str | None, size: int | None) -> None:
        with gate.admit(group, size):
            with lock:
                events.append(f"{name} in")
            release[name].wait(10)
        with lock:
            events.append(f"{name} out")

    def start(name, group=None, size=None):
        thread = threading.Thread(target=run, args=(name, group, size))
        thread.start()
        return thread

    threads = [start("fresh"), start("g1", "g", 2)]
    support.wait_for(lambda: len(events) == 2, 10, "fresh and g1 inside")
    threads.append(start("h", "h", 3))          # another group: waits for g to leave
    threads.append(start("g2", "g", 2))         # its own group: goes in beside it
    support.wait_for(lambda: "g2 in" in events, 10, "g2 inside")
    threads.append(start("solo", "s", 1))       # alone: waits for the engine to empty
    support.wait_for(lambda: gate._alone_waiting == 1, 10, "the lone suspect waiting")
    threads.append(start("late"))               # arrives after it: waits for it
    for name in ("g1", "g2"):
        release[name].set()
    support.wait_for(lambda: "g2 out" in events, 10, "g out")
    assert "h in" not in events                 # the lone suspect's wait holds everyone new back
    for name in ("fresh", "solo", "h", "late"):
        release[name].set()
    for thread in threads:
        thread.join(10)
    order = [e for e in events if e.endswith(" in")]
    assert order[:3] == ["fresh in", "g1 in", "g2 in"]
    assert order[3] == "solo in" and events.index("solo in") > events.index("fresh out")
    assert set(order[4:]) == {"h in", "late in"}
