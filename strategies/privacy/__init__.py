"""Privacy layer of the library: accountants, calibration, mechanisms, budgets and the server's ledger.

* :mod:`.accountants`   one :class:`~.accountants.Accountant` interface; Opacus RDP/PRV and Google
  dp_accounting (RDP with Poisson or without-replacement sampling, PLD) behind it.
* :mod:`.calibration`   one calibrator: the smallest noise whose accountant ε meets a target.
* :mod:`.mechanisms`    ℓ2 clipping and the Gaussian mechanism on a clipped sum (client-level DP).
* :mod:`.budget`        one spent-vs-budget rule with one tolerance.
* :mod:`.ledger`        the server's own per-client ε ledger (composed from mechanism parameters).
* :mod:`.threat_models` the one-line threat model of every strategy.
"""
