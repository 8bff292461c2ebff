"""Memory: the planner (what an engine costs, solved for what fits a budget; pure arithmetic, no
torch), the budget (what memory there is), and the tracker (what a step really used)."""
