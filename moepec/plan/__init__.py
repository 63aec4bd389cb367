"""The planner users run before a job: the simulator (`moepec simulate`), the advisor
(`moepec advise`) and the simulator's report. It computes from a model's shape, a cluster
and its failure rate with the library's own selectors and PLT ledger, and measures nothing
(the measuring is `moepec.bench`'s: `moepec bench gpu`, `moepec bench validate`)."""
